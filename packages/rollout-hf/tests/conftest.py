"""A tiny Qwen2 model built from a config and saved to a temporary directory (no downloads)."""

from __future__ import annotations

import pytest

from posttrain.core.testing import tiny_model

TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=256,
    eos_token_id=2,
    pad_token_id=0,
)
"""The rollout tests' variant of ``posttrain.core.testing``'s tiny Qwen2: 512 tokens, two heads of 64."""


def build_tiny_model(seed: int = 0, tied: bool = False):
    return tiny_model(seed=seed, tie_word_embeddings=tied, **TINY).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    build_tiny_model().save_pretrained(path)
    return str(path)
