"""``model.enable_gradient_checkpointing=null`` is chosen (and logged) where the engine builds the model; an
explicit value is kept."""

from __future__ import annotations

import torch

from posttrain.core.config import ModelConfig
from posttrain.core.memory_policy import resolve_gradient_checkpointing
from posttrain.fsdp.config import FSDP2EngineConfig


def test_null_is_chosen_and_logged_explicit_is_kept(capsys) -> None:
    engine = FSDP2EngineConfig(dtype="float32", max_token_len_per_gpu=4096)
    cpu = torch.device("cpu")
    chosen = resolve_gradient_checkpointing(ModelConfig(enable_gradient_checkpointing=None), engine, cpu, 1)
    assert chosen.enable_gradient_checkpointing is False
    assert "model.enable_gradient_checkpointing=False (chosen: on cpu" in capsys.readouterr().err
    forward = FSDP2EngineConfig(dtype="float32", forward_only=True)
    ref = resolve_gradient_checkpointing(ModelConfig(enable_gradient_checkpointing=None), forward, cpu, 1)
    assert ref.enable_gradient_checkpointing is False
    for value in (True, False):
        kept = resolve_gradient_checkpointing(
            ModelConfig(enable_gradient_checkpointing=value), engine, cpu, 1
        )
        assert kept.enable_gradient_checkpointing is value
    assert capsys.readouterr().err.count("chosen") == 1  # the forward-only one; explicit values print nothing
