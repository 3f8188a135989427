"""The few torch.distributed queries the checkpoint code needs, valid with or without a process group."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch.distributed as dist


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """Rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Barrier on ``group``; nothing without a process group."""
    if is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def single_process_dcp() -> Iterator[bool]:
    """Yield DCP's ``no_dist`` flag; without a process group, silence DCP's "assuming a single process"
    warning."""
    no_dist = not is_initialized()
    if not no_dist:
        yield no_dist
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield no_dist
