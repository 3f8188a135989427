"""SFT and GRPO through the trainers with ``model_engine=megatron`` (CPU, one rank, the test environment of
``megatron_cpu.py``): checkpoints in Megatron's dist_ckpt layout with the HF export (``hf_model``), and a run
resumed from a mid-run checkpoint that repeats the uninterrupted run bitwise (every logged number but the
timings, and the exported weights). The SFT run's validation loss equals an HF forward of its own export. The
checks are ``bench/resume_check.py`` and ``bench/export_check.py``, the scripts the GPU runs use.

The GPU form of these runs (the examples' scripts on the 0.5B shape, Megatron-FSDP's fsdp_dtensor layout, real
Transformer Engine) is ``scripts/gpu_checks.sh megatronrun``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SFT_CPU = [
    "model_engine=megatron",
    "model.enable_gradient_checkpointing=false",
    "data.max_length=128",
    "data.truncation=error",
    "data.train_batch_size=16",
    "data.seed=1",
    "actor.engine.dtype=float32",
    "actor.engine.use_distributed_optimizer=false",
    "actor.engine.use_dynamic_bsz=true",
    "actor.engine.max_token_len_per_gpu=4096",
    "actor.optim.lr=3e-3",
    "actor.optim.weight_decay=0.0",
    "actor.optim.lr_warmup_steps=5",
    "actor.optim.lr_decay_style=cosine",
    "actor.optim.min_lr=3e-4",
    "actor.optim.clip_grad=1.0",
    "trainer.logger=[file]",
]
"""The ``sft_tiny`` preset's settings on the megatron engine (the preset itself sets FSDP-only keys)."""

EXPORT = "checkpoint.save_contents=[model,optimizer,extra,hf_model]"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_cpu import trainer_assets

    return trainer_assets(
        tmp_path_factory.mktemp("trainers_megatron"), size="tiny", num_train=256, num_test=32, digits=2
    )


def _paths(assets, run_dir: Path) -> list[str]:
    return [
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        f"trainer.default_local_dir={run_dir}",
    ]


def _resume(step_dir: Path) -> list[str]:
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={step_dir}"]


@pytest.fixture(scope="module")
def sft_runs(assets, megatron_env):
    """An 8-step SFT run (checkpoints at 4 and 8, validation at both) and one resumed from its step 4."""
    from posttrain.trainers.sft import run

    ref, resumed = assets["root"] / "sft_ref", assets["root"] / "sft_resumed"
    common = [f"data.val_files=[{assets['test']}]", "trainer.total_training_steps=8", "trainer.save_freq=4"]
    common += ["trainer.test_freq=4", EXPORT]
    run([*SFT_CPU, *_paths(assets, ref), *common])
    run([*SFT_CPU, *_paths(assets, resumed), *common, *_resume(ref / "global_step_4")])
    return ref, resumed


@pytest.fixture(scope="module")
def grpo_runs(assets, megatron_env):
    """A 4-step GRPO run (HF rollout, checkpoints at 2 and 4) and one resumed from its step 2."""
    from rl_megatron_worker import CPU_DEFAULTS

    from posttrain.trainers.main_ppo import run

    ref, resumed = assets["root"] / "grpo_ref", assets["root"] / "grpo_resumed"
    common = ["trainer.total_training_steps=4", "trainer.save_freq=2", EXPORT]
    run([*CPU_DEFAULTS, *_paths(assets, ref), *common], "grpo")
    run([*CPU_DEFAULTS, *_paths(assets, resumed), *common, *_resume(ref / "global_step_2")], "grpo")
    return ref, resumed


BENCH = Path(__file__).resolve().parents[3] / "bench"


def bench(script: str, *args: object) -> str:
    """Run ``bench/<script>`` as a user would; its output, or an AssertionError with it when it exits
    non-zero."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_sft_checkpoints_are_megatron_dist_ckpt_with_an_hf_export(sft_runs):
    ref, _ = sft_runs
    for step in (4, 8):
        actor = ref / f"global_step_{step}" / "actor"
        assert json.loads((actor / "manifest.json").read_text())["layout"] == "megatron-dist-ckpt"
        assert (actor / "huggingface" / "model.safetensors").is_file()
    assert (ref / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


def test_sft_resume_repeats_the_run_bitwise(sft_runs):
    """bench/resume_check.py at its defaults: every untimed metric of steps 5-8 and the step-8 export
    equal."""
    assert "over steps 5-8: within tolerance" in bench("resume_check.py", *sft_runs)


def test_sft_validation_loss_equals_an_hf_forward_of_the_export(sft_runs):
    """bench/export_check.py: val/loss at step 8 (the engine's float32 token-mean NLL over the validation set)
    against the float64 NLL of the step-8 HF export over the same tokens and masks."""
    assert "step 8: logged val/loss" in bench(
        "export_check.py", sft_runs[0], "--rtol", 1e-5, "--dtype", "float64"
    )


def test_grpo_resume_repeats_the_run_bitwise(grpo_runs):
    ref, resumed = grpo_runs
    assert (
        json.loads((ref / "global_step_2/actor/manifest.json").read_text())["layout"] == "megatron-dist-ckpt"
    )
    assert "over steps 3-4: within tolerance" in bench("resume_check.py", ref, resumed)
