"""Where the trainer's rollout runs: ``trainer.rollout_placement`` = colocated | process."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from posttrain.core.rollout import BaseRollout

    from ..config import PostTrainConfig


def build_rollout(cfg: PostTrainConfig, device: Any) -> BaseRollout:
    """The trainer's rollout: built here on ``device`` (``trainer.rollout_placement=colocated``), or a handle on a
    rollout worker process this rank starts (``process``, :mod:`.remote`)."""
    from .remote import RemoteRollout

    deterministic = cfg.actor.engine.full_determinism  # vLLM: batch-invariant mode
    if cfg.trainer.rollout_placement == "process":
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return RemoteRollout(
            cfg.rollout,
            cfg.model,
            threads=cfg.trainer.rollout_threads,
            rank=rank,
            deterministic=deterministic,
            device=rollout_device(cfg.trainer.rollout_devices),
            trainer_device=device,
        )
    return cfg.rollout.build(cfg.model, device=device, deterministic=deterministic)


def rollout_device(devices: list[str]) -> str:
    """This rank's entry of ``trainer.rollout_devices`` (by its local rank), or the CPU when it is empty."""
    if not devices:
        return "cpu"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if len(devices) != local_world:
        raise ValueError(
            f"trainer.rollout_devices={list(devices)} has {len(devices)} entries for {local_world} trainer "
            "process(es) on this node: give one device per process (indexed by the local rank)"
        )
    return devices[int(os.environ.get("LOCAL_RANK", "0"))]
