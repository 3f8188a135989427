"""The RL run's null memory trades are chosen and logged; explicit values are kept as written (here: the vLLM
rollout's config needs posttrain-rollout-vllm, which the trainers venv lacks)."""

from __future__ import annotations

from posttrain.trainers.config import load_config
from posttrain.trainers.rl.auto_memory import choose_memory_trades

BATCH = ["data.train_batch_size=128", "rollout.n=5", "model.path=/nonexistent"]


def test_null_trades_are_chosen_and_logged(capsys) -> None:
    cfg = load_config([*BATCH, "rollout.name=vllm"], ["grpo_gsm8k", "vllm_gpu"])
    assert cfg.rollout.max_num_seqs is None and cfg.ref.engine.param_offload is None
    lines = choose_memory_trades(cfg, world=2)
    assert cfg.rollout.max_num_seqs == 320  # 64 prompts per rank x 5 responses
    assert cfg.ref.engine.param_offload is False  # no CUDA here: host memory either way
    err = capsys.readouterr().err
    assert "rollout.max_num_seqs=320 (chosen: " in err and len(lines) == 2


def test_explicit_values_win() -> None:
    cfg = load_config(
        [*BATCH, "rollout.name=vllm", "rollout.max_num_seqs=48", "ref.engine.param_offload=true"],
        ["grpo_gsm8k", "vllm_gpu"],
    )
    assert choose_memory_trades(cfg, world=1) == []
    assert cfg.rollout.max_num_seqs == 48 and cfg.ref.engine.param_offload is True
