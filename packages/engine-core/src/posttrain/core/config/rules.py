"""Rules that involve two configs at once (engine x checkpoint), from the Megatron-FSDP guide.

Megatron-FSDP saves DTensor state under ``dist_ckpt`` through Megatron-Bridge's fsdp_dtensor path, which always
regenerates model, optimizer and extra together: an optimizer-only layout cannot be loaded, and async save is
not covered.
"""

from __future__ import annotations

from .checkpoint import CheckpointConfig
from .engine import EngineConfig, McoreEngineConfig


def check_checkpoint_for_engine(engine: EngineConfig, ckpt: CheckpointConfig, role: str = "actor") -> None:
    """Raise a ValueError naming the fix when ``ckpt`` asks for something ``engine`` cannot do."""
    if not (isinstance(engine, McoreEngineConfig) and engine.use_megatron_fsdp):
        return
    for key in ("save_contents", "load_contents"):
        contents = getattr(ckpt, key)
        if "optimizer" in contents and "model" not in contents:
            raise ValueError(
                f"checkpoint.{key}={list(contents)} with {role}.engine.use_megatron_fsdp=true: Megatron-FSDP "
                f"cannot save or load the optimizer without the model; add model to checkpoint.{key}"
            )
    if ckpt.async_save:
        raise ValueError(
            f"checkpoint.async_save=true with {role}.engine.use_megatron_fsdp=true is not supported "
            "by Megatron-FSDP checkpointing: set checkpoint.async_save=false"
        )
