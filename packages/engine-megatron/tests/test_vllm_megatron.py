"""The megatron engine with vLLM as the rollout, on the CPU: ``posttrain grpo model_engine=megatron
rollout.name=vllm`` under a one-process torchrun (gloo), float32 on both sides. Every step pushes the Megatron
actor's weights into vLLM (Megatron-Bridge's HF export, checksummed by the weight-sync bridge), and vLLM's
log-probs of its own samples equal the actor's recomputed ones. With a learning rate large enough that one
update moves the log-probs by far more than the bound, a push that missed a tensor, mapped a name wrong or
came a step late fails here.

Needs vLLM that runs on the CPU: ``packages/engine-megatron/ci/vllm_cpu.sh`` builds that venv (the nox session
``megatron_vllm_cpu``) and sets POSTTRAIN_REQUIRE_VLLM=1, under which a missing vLLM fails instead of
skipping.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
        raise RuntimeError("POSTTRAIN_REQUIRE_VLLM=1 but vllm is not importable here")
    pytest.skip("needs vLLM (packages/engine-megatron/ci/vllm_cpu.sh)", allow_module_level=True)
if os.environ.get("POSTTRAIN_REQUIRE_VLLM") != "1":
    from vllm.platforms import current_platform

    if not current_platform.device_type:  # e.g. the workspace's CUDA build of vLLM on a machine without a GPU
        pytest.skip(
            "vLLM found no platform to run on here (packages/engine-megatron/ci/vllm_cpu.sh builds one that "
            "runs on the CPU)",
            allow_module_level=True,
        )

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = Path(__file__).with_name("rl_megatron_worker.py")
BOUND = 1e-4
"""Largest |vLLM log-prob - actor log-prob| of a sampled token (float32 both sides; measured ~1e-6)."""


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from megatron_cpu import trainer_assets
    from safetensors import safe_open

    from posttrain.core.testing import torchrun
    from posttrain.trainers.logging import read_metrics

    assets = trainer_assets(
        tmp_path_factory.mktemp("vllm_megatron"), size="tiny", num_train=16, num_test=4, digits=1
    )
    run = assets["root"] / "run"
    args = [f"model.path={assets['model']}", f"data.train_files=[{assets['train']}]"]
    args += [f"trainer.default_local_dir={run}", "rollout.name=vllm", "rollout.response_length=8"]
    args += ["actor.optim.lr=1e-2", "trainer.total_training_steps=3"]
    torchrun(WORKER, *args, nproc=1, timeout=900)
    with safe_open(str(assets["model"] / "model.safetensors"), "pt") as f:
        hf_tensors = len(list(f.keys()))
    return read_metrics(run / "metrics.jsonl"), hf_tensors


def test_every_step_pushes_every_tensor(rows):
    metrics, hf_tensors = rows
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(r["sync/tensors"] == hf_tensors and r["timing_s/update_weights"] > 0 for r in metrics)


def test_vllm_samples_with_the_actors_weights(rows):
    """After each update the next step's samples are scored by vLLM and by the actor alike."""
    metrics, _ = rows
    diffs = [r["rollout/logprob_diff/max"] for r in metrics]
    assert max(diffs) < BOUND, diffs
    assert metrics[-1]["actor/grad_norm"] > 0
