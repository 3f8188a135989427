"""Tied embeddings (Qwen2.5-0.5B/1.5B style): the stream carries ``embed_tokens`` only, and vLLM's lm_head
must follow it. On CPU vLLM keeps a prepacked copy of the lm_head GEMM, which a layerwise reload used to leave
stale:
the log-probs drifted from the trained model's by up to 0.26 after a few GRPO steps."""

from __future__ import annotations

import pytest
from conftest import needs_vllm
from vllm_testing import (
    ROLLOUT_DTYPE,
    check_greedy,
    engine_weights,
    hf_model,
    make_engine,
    save_tiny_model,
    train_step,
)

from posttrain.core.config import ModelConfig

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [100, 3, 250, 9, 9, 41]]


def test_tied_lm_head_follows_every_sync(tmp_path):
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    path = save_tiny_model(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    config = VLLMRolloutConfig(
        executor="inprocess",
        dtype=ROLLOUT_DTYPE,
        prompt_length=64,
        response_length=16,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        update_weights_bucket_megabytes=1,
        engine_kwargs={"block_size": 32},
    )
    rollout = VLLMRollout(config, ModelConfig(path=path))
    engine = make_engine(path)
    try:
        for seed in (1, 2):
            train_step(engine, seed=seed)
            stream, peft = engine.get_per_tensor_param()
            rollout.update_weights(stream, peft_config=peft)
            weights, _ = engine_weights(engine)
            assert "lm_head.weight" not in weights
            check_greedy(rollout, hf_model(path, weights), PROMPTS)
    finally:
        rollout.release()
