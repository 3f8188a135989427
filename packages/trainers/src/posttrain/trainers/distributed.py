"""Process-group set-up for trainers started by torchrun (or as one plain process) and small collectives.

Under torchrun (``WORLD_SIZE`` set) the default group is created with NCCL when CUDA is visible, else gloo,
and each process takes GPU ``LOCAL_RANK``. A plain ``python`` run stays single-process with no group. The
helpers reduce Python floats over the whole world and are no-ops without a group.

:class:`Replicas` is what a trainer needs to drive a model-parallel engine (Megatron TP/PP/CP > 1): the ranks
of one model-parallel group share a data-parallel rank, so they must consume the same batch, and only one of
them (``is_mp_src_rank_with_outputs()``) gets the engine's outputs and loss metrics back. The trainer makes
the data on that source rank and broadcasts it, then broadcasts outputs and metrics the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from posttrain.core import BaseEngine

T = TypeVar("T")


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
            f"{expected}: set trainer.nnodes and trainer.n_gpus_per_node so that their product is "
            f"{world_size()}"
        )


Layout = tuple[tuple[int, bool], ...]
"""``(data-parallel rank, is the model-parallel source rank)`` of every global rank, in rank order."""


def engine_layout(engine: BaseEngine) -> Layout:
    """Gather every rank's data-parallel rank and source flag (collective)."""
    mine = (int(engine.get_data_parallel_rank()), bool(engine.is_mp_src_rank_with_outputs()))
    if world_size() == 1:
        return (mine,)
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, mine)
    return tuple(tuple(x) for x in gathered)


@dataclass(frozen=True)
class Replicas:
    """This rank's replica group: the ranks sharing its data-parallel rank, and the one with the outputs."""

    layout: Layout
    """The engine layout the group was built from."""
    group: Any
    """Process group of the replicas; None when every rank is its own data-parallel rank."""
    src: int
    """Global rank that gets the engine's outputs; it also generates the group's rollouts."""
    size: int
    """Ranks in the group (tensor x pipeline x context parallel)."""

    @property
    def is_src(self) -> bool:
        return rank() == self.src

    def broadcast(self, obj: T) -> T:
        """``obj`` as the source rank has it, on every rank of the group (pickled; pass None elsewhere)."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def replica_groups(engine: BaseEngine) -> Replicas:
    """Build the replica groups of ``engine``'s layout (collective: every rank creates every group, in
    data-parallel-rank order); without model parallelism no group is made."""
    layout = engine_layout(engine)
    me = rank()
    dp_rank = layout[me][0]
    by_dp: dict[int, list[int]] = {}
    for r, (d, _) in enumerate(layout):
        by_dp.setdefault(d, []).append(r)
    for d, ranks in by_dp.items():
        sources = [r for r in ranks if layout[r][1]]
        if len(sources) != 1:
            raise RuntimeError(
                f"data-parallel rank {d} has ranks {ranks} of which {sources} report outputs: an engine must "
                "return outputs on exactly one rank of each model-parallel group"
            )
    if len(by_dp) == len(layout):
        return Replicas(layout=layout, group=None, src=me, size=1)
    group = None
    for d in sorted(by_dp):
        made = dist.new_group(by_dp[d])
        if d == dp_rank:
            group = made
    (src,) = [r for r in by_dp[dp_rank] if layout[r][1]]
    return Replicas(layout=layout, group=group, src=src, size=len(by_dp[dp_rank]))
