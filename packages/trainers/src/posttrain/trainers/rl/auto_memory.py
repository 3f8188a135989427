"""The RL run's memory-for-speed trades that the config leaves null (``ref.engine.param_offload``, vLLM's
``rollout.max_num_seqs``), chosen before any engine is built by :mod:`posttrain.core.memory_policy`; an
explicit value is kept. ``model.enable_gradient_checkpointing=null`` is chosen by the FSDP engine itself."""

from __future__ import annotations

import sys
from typing import Any

import torch

from posttrain.core.memory_policy import ModelShape, choose_max_num_seqs, choose_ref_offload


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
