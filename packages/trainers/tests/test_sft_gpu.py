"""SFT on CUDA (run on the GPU machine): bf16 on one GPU learns and reports MFU; two GPUs match one.

Skipped without CUDA. The tiny offline model keeps these to seconds of GPU time.
"""

from __future__ import annotations

import pytest
import torch
from sft_fixtures import make_arithmetic, make_tiny_model

from posttrain.core.testing import torchrun
from posttrain.trainers.logging import read_metrics
from posttrain.trainers.sft import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def gpu_args(model, train, run_dir, *extra):
    return [
        "--config",
        "sft_tiny",
        f"model.path={model}",
        f"data.train_files=[{train}]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[file]",
        "trainer.total_training_steps=8",
        "actor.engine.dtype=bfloat16",
        *extra,
    ]


def test_sft_bf16_on_one_gpu_learns_and_reports_mfu(tmp_path):
    train, _ = make_arithmetic(tmp_path, num_train=256, num_test=8)
    run(gpu_args(make_tiny_model(tmp_path), train, tmp_path / "run"))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 1.0
    assert all(0 < r["perf/mfu"] < 1 for r in rows)  # H100/H200 peaks are in posttrain.trainers.perf


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_one_gpu_first_step(tmp_path):
    train, _ = make_arithmetic(tmp_path, num_train=256, num_test=8)
    model = make_tiny_model(tmp_path)
    fp32 = ("actor.engine.dtype=float32", "trainer.total_training_steps=1")
    run(gpu_args(model, train, tmp_path / "one", *fp32))
    torchrun(
        "posttrain.trainers.sft",
        *gpu_args(model, train, tmp_path / "two", *fp32),
        "trainer.n_gpus_per_node=2",
        module=True,
        timeout=300,
    )
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")[0]
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")[0]
    assert abs(one["train/loss"] - two["train/loss"]) < 1e-4
    assert abs(one["train/grad_norm"] - two["train/grad_norm"]) < 1e-3
