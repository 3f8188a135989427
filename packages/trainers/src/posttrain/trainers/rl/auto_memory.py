"""The RL run's memory-for-speed trades that the config leaves null (``ref.engine.param_offload``, vLLM's
``rollout.max_num_seqs``), chosen before any engine is built by :mod:`posttrain.core.memory_policy`; an
explicit value is kept. ``model.enable_gradient_checkpointing=null`` is chosen here when a vLLM rollout will
hold its memory on the actor's GPU while the actor trains (:func:`checkpointing_beside_rollout`), and by the
actor's engine from the free memory otherwise (in sync mode vLLM sleeps through the update)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from posttrain.core.memory_policy import (
    ModelShape,
    choose_gradient_checkpointing,
    choose_max_num_seqs,
    choose_ref_offload,
    rollout_reserve_bytes,
)

from .modes import rollout_device


def choose_memory_trades(cfg: Any, world: int, rank: int = 0) -> list[str]:
    """Fill the null trades of ``cfg`` in place and return one ``key=value (chosen: why)`` line per choice
    (also printed on rank 0)."""
    lines = []
    sequences = max(cfg.data.train_batch_size // max(world, 1), 1) * cfg.rollout.n
    if getattr(cfg.rollout, "max_num_seqs", 0) is None:
        choice = choose_max_num_seqs(sequences)
        cfg.rollout.max_num_seqs = choice.value
        lines.append(choice.line("rollout.max_num_seqs"))
    if cfg.ref.engine.param_offload is None:
        choice = ref_offload_choice(cfg, world, sequences)
        cfg.ref.engine.param_offload = choice.value
        lines.append(choice.line("ref.engine.param_offload"))
    if cfg.model.enable_gradient_checkpointing is None and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        choice = checkpointing_beside_rollout(cfg, world, device, torch.cuda.mem_get_info(device)[0])
        if choice is not None:
            cfg.model.enable_gradient_checkpointing = choice.value
            lines.append(choice.line("model.enable_gradient_checkpointing"))
    if rank == 0:
        for line in lines:
            print(f"[posttrain] {line}", file=sys.stderr)
    return lines


def ref_offload_choice(cfg: Any, world: int, sequences: int) -> Any:
    from posttrain.core.memory_policy import Choice

    if not torch.cuda.is_available():
        return Choice(False, "no CUDA device: the reference stays in host memory either way")
    free = torch.cuda.mem_get_info()[0]
    share = getattr(cfg.rollout, "gpu_memory_utilization", 0.5)
    tokens = sequences * (cfg.rollout.prompt_length + cfg.rollout.response_length)
    return choose_ref_offload(ModelShape.from_path(cfg.model.path), free, world, share, tokens)


def checkpointing_beside_rollout(cfg: Any, world: int, device: torch.device, free: int) -> Any:
    """The actor's activation recomputation with ``free`` bytes free on its ``device`` before the engines are
    built, when a vLLM rollout on that device generates while the actor trains (a mode other than sync, the
    rollout on the trainer's own GPU) and so holds its share through the update (on one H100 the 0.5B
    README work ran out of memory in one_step_off with recomputation chosen off from the whole free memory).
    None where the engine chooses alone: sync, another device, a rollout without a memory share, or no
    micro-batch token budget."""
    engine = cfg.actor.engine
    share = getattr(cfg.rollout, "gpu_memory_utilization", None)
    if cfg.trainer.mode == "sync" or share is None or not engine.use_dynamic_bsz:
        return None
    if rollout_device(cfg.trainer.rollout_devices, device) != str(device):
        return None
    shape = ModelShape.from_path(cfg.model.path)
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    reserve = rollout_reserve_bytes(
        shape,
        free,
        world,
        share,
        ref_on_device=use_ref and not cfg.ref.engine.param_offload,
        gib=getattr(cfg.rollout, "gpu_memory_gib", 0),
    )
    return choose_gradient_checkpointing(shape, engine.max_token_len_per_gpu, free, world, beside=reserve)
