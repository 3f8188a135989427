"""``posttrain sft`` and ``posttrain grpo`` with ``model_engine=torchtitan`` on a tiny Qwen3 (in process), a
run saved by the torchtitan engine resumed by the FSDP engine, and a model torchtitan lacks refused up
front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.trainers.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assets")
    assert main(["model", "init", "--arch", "qwen3", "--size", "tiny", "--out", str(root / "q3")]) == 0
    assert main(["data", "synthetic", "--task", "arithmetic", "--digits", "1", "--num-train", "16",
                 "--num-test", "8", "--out", str(root / "arith")]) == 0  # fmt: skip
    return root


def _sft(assets: Path, out: Path, engine: str, steps: int, model: Path | None = None) -> int:
    return main(
        [
            "sft", "--config", "sft_tiny", f"model.path={model or assets / 'q3'}", f"model_engine={engine}",
            f"data.train_files=[{assets / 'arith' / 'train.parquet'}]",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out}",
        ]
    )  # fmt: skip


def _steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "step" in r]


def test_sft_on_torchtitan_resumes_on_fsdp2(assets, tmp_path):
    run = tmp_path / "sft"
    assert _sft(assets, run, "torchtitan", 2) == 0
    manifest = json.loads((run / "global_step_2" / "actor" / "manifest.json").read_text())
    assert manifest["backend"] == "torchtitan"
    assert _sft(assets, run, "fsdp2", 3) == 0  # resumes from global_step_2 on the other backend
    assert (run / "global_step_3").is_dir()
    assert _steps(run)[-1] == 3


def test_grpo_on_torchtitan(assets, tmp_path):
    run = tmp_path / "grpo"
    argv = [
        "grpo", "--config", "grpo_tiny", f"model.path={assets / 'q3'}", "model_engine=torchtitan",
        f"data.train_files=[{assets / 'arith' / 'train.parquet'}]", "data.train_batch_size=8",
        "trainer.total_training_steps=1", f"trainer.default_local_dir={run}",
    ]  # fmt: skip
    assert main(argv) == 0
    assert _steps(run) == [1]


def test_ppo_with_a_torchtitan_critic(assets, tmp_path):
    """GAE: the critic is the torchtitan value model; its checkpoint is the FSDP critic's layout."""
    run = tmp_path / "ppo"
    argv = [
        "ppo", "--config", "grpo_tiny", "algorithm.adv_estimator=gae", f"model.path={assets / 'q3'}",
        "model_engine=torchtitan", f"data.train_files=[{assets / 'arith' / 'train.parquet'}]",
        "data.train_batch_size=8", "trainer.total_training_steps=1", "trainer.save_freq=1",
        f"trainer.default_local_dir={run}",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("critic/vf_loss" in r or "vf_loss" in json.dumps(r) for r in rows)
    manifest = json.loads((run / "global_step_1" / "critic" / "manifest.json").read_text())
    assert manifest["backend"] == "torchtitan"


def test_model_torchtitan_lacks_is_refused(assets, tmp_path):
    assert main(["model", "init", "--arch", "qwen2", "--size", "tiny", "--out", str(tmp_path / "q2")]) == 0
    with pytest.raises(ValueError, match="no Qwen2 model.*model_engine=fsdp2"):
        _sft(assets, tmp_path / "run", "torchtitan", 1, model=tmp_path / "q2")
    assert not (tmp_path / "run" / "global_step_1").exists()


def test_sft_on_a_qwen3_moe(assets, tmp_path):
    """`posttrain model init --arch qwen3_moe` writes a model the torchtitan engine trains and resumes."""
    moe = tmp_path / "moe"
    assert main(["model", "init", "--arch", "qwen3_moe", "--size", "tiny", "--out", str(moe)]) == 0
    run = tmp_path / "sft"
    assert _sft(assets, run, "torchtitan", 1, model=moe) == 0
    assert _sft(assets, run, "torchtitan", 2, model=moe) == 0  # resumes from global_step_1
    assert _steps(run)[-1] == 2
