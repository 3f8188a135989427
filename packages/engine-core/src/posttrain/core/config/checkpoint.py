"""Checkpoint config: what a save writes and what a load reads.

Contents are subsets of ``model``, ``optimizer``, ``extra`` (LR scheduler, RNG, counters, dataloader position)
and ``hf_model`` (full Hugging Face safetensors next to the sharded checkpoint). Engine-specific rules (the
Megatron-FSDP ones) are each engine config's ``check_checkpoint``; a backend's own checkpoint settings (the
megatron engine's ``portable_checkpoint``, ``hf_save_kwargs``) are fields of its engine config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CONTENTS = ("model", "optimizer", "extra", "hf_model")


def check_contents(contents: list[str], key: str) -> None:
    """Raise if ``contents`` names an unknown item or breaks a dependency between items."""
    unknown = [c for c in contents if c not in CONTENTS]
    if unknown:
        raise ValueError(
            f"{key}={list(contents)} has unknown item(s) {unknown}: choose from {', '.join(CONTENTS)}"
        )
    if "hf_model" in contents and "model" not in contents:
        raise ValueError(
            f"{key}={list(contents)} lists hf_model without model: the HF export is written from "
            f"the model state, add model to {key}"
        )
    if "optimizer" in contents and "model" not in contents:
        raise ValueError(
            f"{key}={list(contents)} lists optimizer without model: optimizer state is keyed by "
            f"the model's parameters, add model to {key}"
        )


@dataclass(kw_only=True)
class CheckpointConfig:
    """What to save and load, and how."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Items a save writes: model, optimizer, extra, hf_model."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Items a load restores (a subset of what was saved)."""
    async_save: bool = False
    """Block training only for the device-to-host snapshot and write in the background."""
    max_ckpt_to_keep: int | None = None
    """Keep at most this many checkpoints (older ones are deleted after a new save succeeds); None keeps
    all."""

    def __post_init__(self) -> None:
        check_contents(self.save_contents, "checkpoint.save_contents")
        check_contents(self.load_contents, "checkpoint.load_contents")
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            raise ValueError(
                f"checkpoint.max_ckpt_to_keep={self.max_ckpt_to_keep} must be >= 1 or null (keep all)"
            )
