"""The shared engine config, the optimizer and checkpoint configs: each bad value raises and names the fix."""

import pytest

from posttrain.core.config import (
    CheckpointConfig,
    EngineConfig,
    OptimizerConfig,
    RouterReplayConfig,
)


def test_hf_model_without_model():
    with pytest.raises(ValueError, match="add model to checkpoint.load_contents"):
        CheckpointConfig(load_contents=["hf_model"])
    with pytest.raises(ValueError, match="unknown item"):
        CheckpointConfig(save_contents=["model", "weights"])


@pytest.mark.parametrize("dtype", ["int8", "float64", "bf8"])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="use one of bfloat16, float16, float32"):
        EngineConfig(dtype=dtype)


def test_dtype_aliases():
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"
    assert EngineConfig(dtype="half").dtype == "float16"


def test_router_replay_modes():
    for mode in ("disabled", "R2", "R3"):
        RouterReplayConfig(mode=mode)
    with pytest.raises(ValueError, match="use disabled, R2 or R3"):
        RouterReplayConfig(mode="R4")


def test_logits_chunk_size_follows_chunking_flag():
    assert EngineConfig(entropy_from_logits_chunk_size=64).logits_chunk_size(1000) == 64
    assert EngineConfig(entropy_from_logits_with_chunking=False).logits_chunk_size(1000) == 1000
    with pytest.raises(ValueError, match="entropy_from_logits_chunk_size=0 must be >= 1"):
        EngineConfig(entropy_from_logits_chunk_size=0)
    with pytest.raises(ValueError, match="pad_to_length_bucket=0 must be >= 1"):
        EngineConfig(pad_to_length_bucket=0)


def test_optimizer_schedule():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine")
    assert cfg.lr_multiplier(0, 10) == pytest.approx(0.5)
    assert cfg.lr_multiplier(1, 10) == pytest.approx(1.0)
    assert cfg.lr_multiplier(2, 10) == pytest.approx(1.0)
    assert cfg.lr_multiplier(10, 10) == pytest.approx(0.1)
    lin = OptimizerConfig(lr=1.0, lr_decay_style="linear", min_lr=0.0)
    assert lin.lr_multiplier(5, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="use one of constant, cosine, linear"):
        OptimizerConfig(lr_decay_style="step")


def test_auto_dtype_is_float32_without_cuda_and_bfloat16_with_it(monkeypatch, caplog):
    import logging

    import torch

    from posttrain.core.config.engine import resolve_compute_dtype

    assert EngineConfig().dtype == "auto"  # resolved when an engine is built, not at load time
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = EngineConfig()
    with caplog.at_level(logging.INFO, logger="posttrain"):
        assert resolve_compute_dtype(cpu) == "float32" and cpu.dtype == "float32"
    assert "engine.dtype=auto -> float32" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_compute_dtype(EngineConfig()) == "bfloat16"
    assert resolve_compute_dtype(EngineConfig(dtype="fp16")) == "float16"  # an explicit dtype is kept
