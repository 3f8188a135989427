"""`posttrain demo` plumbing, shortened: model init -> data -> SFT (HF export) -> GRPO from that export."""

from __future__ import annotations

import pytest

from posttrain.trainers.demo import DemoConfig, run
from posttrain.trainers.logging import read_metrics


@pytest.mark.slow
def test_demo_pipeline_end_to_end(tmp_path):
    cfg = DemoConfig(out_dir=str(tmp_path), num_train=64, num_test=16, sft_steps=3, grpo_steps=2)
    result = run(cfg)
    assert set(result) == {"test_reward_sft", "test_reward_grpo", "seconds"}
    assert 0.0 <= result["test_reward_sft"] <= 1.0 and 0.0 <= result["test_reward_grpo"] <= 1.0
    assert (tmp_path / "sft" / "global_step_3" / "actor" / "huggingface" / "config.json").is_file()
    rows = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward/mean" in rows[-1]
    assert (tmp_path / "grpo" / "metrics.png").is_file() and (tmp_path / "grpo" / "global_step_2").is_dir()
