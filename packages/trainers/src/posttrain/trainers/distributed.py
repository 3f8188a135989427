"""Process-group set-up for trainers started by torchrun (or as one plain process) and small collectives.

Under torchrun (``WORLD_SIZE`` set) the default group is created with NCCL when CUDA is visible, else gloo, and
each process takes GPU ``LOCAL_RANK``. A plain ``python`` run stays single-process with no group. The helpers
reduce Python floats over the whole world and are no-ops without a group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist


def init_distributed() -> bool:
    """Create the default process group when launched by torchrun; return True if this call created it."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(values: Sequence[float], op: str = "sum") -> list[float]:
    """Sum (or max) each value over every rank, in float64."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu().tolist()


def check_world_size(expected: int) -> None:
    """Raise unless the launched world matches ``trainer.nnodes * trainer.n_gpus_per_node``."""
    if world_size() != expected:
        raise ValueError(
            f"this run has {world_size()} processes but trainer.nnodes x trainer.n_gpus_per_node = "
            f"{expected}: set trainer.nnodes and trainer.n_gpus_per_node so that their product is {world_size()}"
        )
