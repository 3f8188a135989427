"""Checks and loads on the model directory that the SFT and RL trainers share."""

from __future__ import annotations

from typing import Any

from posttrain.core.config import EngineConfig, ModelConfig


def require_model_weights(
    model: ModelConfig, engine: EngineConfig, rollout_loads_weights: bool = False
) -> None:
    """Refuse a ``model.path`` without weights before anything is built
    (:meth:`~posttrain.core.config.ModelConfig.require_weights`); an actor ``engine`` that starts from a
    Megatron dist_ckpt (``use_dist_checkpointing``) needs none, unless a rollout loads them too."""
    from_dist_ckpt = getattr(engine, "use_dist_checkpointing", False)
    if rollout_loads_weights or not from_dist_ckpt:
        model.require_weights("model.path")


def load_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer of ``model`` (its ``tokenizer_dir``); a ValueError naming the fix when no path is set."""
    from transformers import AutoTokenizer

    if not model.tokenizer_dir:
        raise ValueError(
            "model.path is empty: set model.path=<local HF model dir> (make a tiny one with "
            "`posttrain model init --size tiny --out DIR`)"
        )
    return AutoTokenizer.from_pretrained(model.tokenizer_dir, trust_remote_code=model.trust_remote_code)
