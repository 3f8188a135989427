"""SFT end to end on the tiny offline model and the synthetic arithmetic task (CPU).

One uninterrupted single-process run (8 steps, checkpoints at 4 and 8) is the reference: its loss must fall,
a run resumed from its step-4 checkpoint must reproduce steps 5-8 bitwise (losses, grad norms, sampler
position, final weights), and a 2-process torchrun must give the same first-step loss and grad norm (1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sft_fixtures import make_arithmetic, make_tiny_model, threads_picked_elsewhere

from posttrain.ckpt import load_full_model_state, load_trainer_state
from posttrain.core.testing import torchrun
from posttrain.trainers import cli
from posttrain.trainers.logging import read_metrics
from posttrain.trainers.sft import run

STEPS = 8


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    train, test = make_arithmetic(root, num_train=256, num_test=32)
    return {"root": root, "model": make_tiny_model(root), "train": train, "test": test}


def sft_args(assets, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        "sft_tiny",
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        f"data.val_files=[{assets['test']}]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[file]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=4",
        "trainer.test_freq=4",
        "trainer.peak_tflops=0.5",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(assets):
    run_dir = assets["root"] / "reference"
    run(sft_args(assets, run_dir))
    return run_dir


@pytest.mark.slow
def test_sft_loss_falls_and_writes_metrics_checkpoints_and_curves(reference):
    rows = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "perf/step_s", "perf/mfu"):
        assert all(key in r for r in rows), key
    assert all(0 < r["perf/mfu"] < 1 for r in rows)
    losses = [r["train/loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    vals = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert (reference / "metrics.png").is_file()
    assert (reference / "global_step_4" / "actor").is_dir() and (
        reference / "global_step_8" / "data.pt"
    ).is_file()
    assert (reference / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


@pytest.mark.slow
def test_token_accuracy_is_shown_and_equals_an_hf_reference(assets, reference, tmp_path):
    """train/token_acc on every step (rising as the loss falls); val/token_acc at step 8 against the float64
    argmax of the exported step-8 model over the validation set's loss-masked tokens."""
    from transformers import AutoModelForCausalLM

    from posttrain.ckpt import export_hf
    from posttrain.core.testing import argmax_hits
    from posttrain.trainers.config import SFTConfig, load_config
    from posttrain.trainers.data.sft_dataset import SFTDataset
    from posttrain.trainers.model_files import load_tokenizer

    rows = read_metrics(reference / "metrics.jsonl")
    accs = [r["train/token_acc"] for r in rows]
    assert all(0 <= a <= 1 for a in accs) and accs[-1] > accs[0], accs
    export_hf(reference / "global_step_8" / "actor", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    cfg = load_config(sft_args(assets, tmp_path / "unused")[2:], ["sft_tiny"], root=SFTConfig)
    val = SFTDataset(cfg.data.val_files, load_tokenizer(cfg.model), cfg.data, key="data.val_files")
    pairs = [
        (torch.as_tensor(ids), torch.as_tensor(mask, dtype=torch.float64))
        for ids, mask in zip(val.input_ids, val.loss_mask)
    ]
    hits = sum(float((argmax_hits(hf, [ids]) * mask).sum()) for ids, mask in pairs)
    count = sum(float(mask.sum()) for _, mask in pairs)
    # the engine's fp32 logits and HF's may order a near-tie differently: at most one token
    assert abs(rows[-1]["val/token_acc"] - hits / count) <= 1 / count + 1e-12, (
        rows[-1]["val/token_acc"],
        hits,
    )
    assert 0 < hits < count


@pytest.mark.slow
def test_resume_mid_epoch_is_bitwise_identical(assets, reference):
    resumed = assets["root"] / "resumed"
    run(
        sft_args(
            assets,
            resumed,
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={reference / 'global_step_4'}",
            "checkpoint.async_save=true",  # prepared host buffers + background writes: same bits on disk
        )
    )
    ref = {r["step"]: r for r in read_metrics(reference / "metrics.jsonl")}
    new = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in new] == list(range(5, STEPS + 1))
    for r in new:
        for key in (
            "train/loss",
            "train/grad_norm",
            "train/lr",
            "train/samples_seen",
            "train/epoch",
            "val/loss",
        ):
            if key in ref[r["step"]]:
                assert r[key] == ref[r["step"]][key], (r["step"], key)
    # the sampler stood at the same position and the final weights are the same bits
    a, b = reference / "global_step_8", resumed / "global_step_8"
    assert load_trainer_state(a)["sampler"] == load_trainer_state(b)["sampler"]
    wa, wb = (
        load_full_model_state(a / "actor" / "dist_ckpt"),
        load_full_model_state(b / "actor" / "dist_ckpt"),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_resume_keeps_the_checkpoints_thread_count(assets, reference, monkeypatch):
    """Where posttrain picks torch's thread count (no OMP_NUM_THREADS), a resume on a machine where it would
    pick another count takes the reference's from its checkpoint (the count is what this checks: on this tiny
    model 1 and 2 threads happened to give the same gradient norms), and its last step's gradient norm equals
    the reference's."""
    saved = load_trainer_state(reference / "global_step_4")["torch_threads"]
    resumed = assets["root"] / "resumed_threads"
    args = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={reference / 'global_step_4'}"]
    with threads_picked_elsewhere(monkeypatch, saved):
        run(sft_args(assets, resumed, *args))
        assert torch.get_num_threads() == saved
    ref = read_metrics(reference / "metrics.jsonl")[-1]
    assert read_metrics(resumed / "metrics.jsonl")[-1]["train/grad_norm"] == ref["train/grad_norm"]


@pytest.mark.slow
def test_resume_auto_continues_from_latest(assets, reference, tmp_path):
    # auto-resume in the reference's own directory: nothing left to do at step 12, and nothing is rewritten
    before = (reference / "metrics.jsonl").read_text()
    run(sft_args(assets, reference))
    assert (reference / "metrics.jsonl").read_text() == before


@pytest.mark.dist
@pytest.mark.slow
def test_two_processes_match_one_process(assets, reference, tmp_path):
    torchrun(
        "posttrain.trainers.sft",
        *sft_args(assets, tmp_path / "dp2"),
        "trainer.n_gpus_per_node=2",
        "data.val_files=[]",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        module=True,
        timeout=300,
    )
    one = read_metrics(reference / "metrics.jsonl")[:2]
    two = read_metrics(tmp_path / "dp2" / "metrics.jsonl")
    assert [r["step"] for r in two] == [1, 2] and two[0]["train/loss_tokens"] == one[0]["train/loss_tokens"]
    assert abs(two[0]["train/loss"] - one[0]["train/loss"]) < 1e-5
    assert abs(two[0]["train/grad_norm"] - one[0]["train/grad_norm"]) < 1e-5
    # warmup makes step 1's LR independent of the run length, so step 2 matches too and the loss fell
    assert (
        abs(two[1]["train/loss"] - one[1]["train/loss"]) < 1e-4
        and two[1]["train/loss"] < two[0]["train/loss"]
    )


def test_cli_reports_config_errors(assets, tmp_path, capsys):
    assert cli.main(["sft", "--config", "sft_tiny", "trainer.no_such_key=1"]) == 2
    assert "unknown config key 'trainer.no_such_key'" in capsys.readouterr().err


def test_an_rl_trainer_mode_is_refused_by_sft(assets, tmp_path):
    with pytest.raises(
        ValueError, match=r"trainer\.mode is a key of the RL trainers.*posttrain sft has no rollout"
    ):
        run(sft_args(assets, tmp_path / "run", "trainer.mode=one_step_off"))
    assert not (tmp_path / "run").exists()


def test_truncation_error_names_the_sample_before_training(assets, tmp_path):
    with pytest.raises(
        ValueError, match=r"train\.parquet row \d+ has \d+ tokens, more than data\.max_length=20"
    ):
        run(sft_args(assets, tmp_path / "run", "data.max_length=20"))
    assert not (tmp_path / "run").exists()


def test_malformed_parquet_fails_before_training(assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"messages": [1, 2, 3]}), bad)
    with pytest.raises(
        ValueError, match=r"bad\.parquet: column 'messages' has type int64, expected list<struct"
    ):
        run(sft_args(assets, tmp_path / "run", f"data.train_files=[{bad}]"))
    with pytest.raises(ValueError, match=r"bad\.parquet: column 'chat' is missing"):
        run(sft_args(assets, tmp_path / "run", f"data.train_files=[{bad}]", "data.messages_key=chat"))
    assert not (tmp_path / "run").exists()


def test_checkpoint_huggingface_folder_without_weights_is_refused_and_export_fixes_it(
    assets, reference, tmp_path
):
    """The default save_contents writes no HF weights: training from that folder would start from a random
    model. It is refused before anything is built, and the command the error names makes it loadable."""
    from posttrain.ckpt.cli import main as ckpt_main
    from posttrain.core.config import ModelConfig

    role = reference / "global_step_4" / "actor"
    folder = role / "huggingface"
    assert (folder / "config.json").is_file()
    with pytest.raises(ValueError, match=r"holds no weights .*hf_model in checkpoint\.save_contents") as err:
        run(sft_args(assets, tmp_path / "run", f"model.path={folder}"))
    assert f"posttrain ckpt export-hf {role} <out dir>" in str(err.value)
    assert not (tmp_path / "run").exists()
    assert ckpt_main(["export-hf", str(role), str(tmp_path / "hf")]) == 0
    ModelConfig(path=str(tmp_path / "hf")).require_weights()


@pytest.mark.slow
def test_defaults_run_without_a_preset(assets, tmp_path):
    """`posttrain sft model.path=... data.train_files=[...]` with every other key at its default trains (the
    micro-batch token budget is filled in), here for two steps."""
    metrics = run(
        [
            f"model.path={assets['model']}",
            f"data.train_files=[{assets['train']}]",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    assert metrics["train/loss"] > 0 and metrics["train/loss_tokens"] > 0
    assert (tmp_path / "global_step_2" / "actor").is_dir()
