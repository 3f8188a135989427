"""Host staging for a synchronous DCP save of device tensors: page-locked copies instead of ``tensor.cpu()``.

DCP's writer threads copy each device tensor to the host with ``tensor.cpu()`` just before writing it: a
pageable allocation per tensor and a pageable device-to-host copy (~18 GB/s on an H200 host, against ~55 GB/s
into page-locked memory), from 8 threads at once. On the GPU machine that made a sync save of the 1.5B model
with AdamW state (18.5 GB) run at 0.93-1.07 GB/s, 0.58 of the disk's raw write, while the async save's write
of the same bytes from page-locked buffers ran at twice that.

:class:`StagingSavePlanner` is DCP's default planner with one change: a tensor that is not on the host is
copied into a page-locked host tensor of exactly its size (:func:`posttrain.ckpt.pinned.host_empty`: plain
memory, written once, then registered with CUDA) and that is what the writer thread writes. Host memory: DCP's
writer keeps every tensor of a file alive until the file is closed, and each thread writes one file, so a save
holds a host copy of the whole local state either way (with ``tensor.cpu()`` too); :class:`HostStaging` keeps
the copies until the save returns and then releases them all. Nothing is kept between saves.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from .pinned import host_empty


class HostStaging:
    """Page-locked host copies of device tensors, held for one save; thread-safe."""

    def __init__(self, pin_device: int | None) -> None:
        self.pin_device = pin_device
        """CUDA device the copies are registered for (None: plain host memory)."""
        self._copies: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @property
    def staged_bytes(self) -> int:
        """Bytes copied to the host so far."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._copies)

    def stage(self, src: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of ``src`` (same shape and dtype) that owns exactly its bytes."""
        host = host_empty(src.shape, src.dtype, self.pin_device)
        host.copy_(src.detach())  # synchronous: the bytes are on the host when this returns
        with self._lock:
            self._copies.append(host)  # registered until the staging is released
        return host

    def release(self) -> None:
        """Drop every copy (unregistered and freed once DCP's references are gone too)."""
        with self._lock:
            self._copies.clear()


class StagingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that hands device tensors to the writer as :class:`HostStaging` copies."""

    def __init__(self, staging: HostStaging) -> None:
        super().__init__()
        self.staging = staging

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            return self.staging.stage(data)
        return data


def staging_device(state: Any) -> int | None:
    """The CUDA device of the first CUDA tensor (or DTensor shard) in nested ``state``, or None."""
    if isinstance(state, torch.Tensor):
        if state.device.type != "cuda":
            return None
        return state.device.index if state.device.index is not None else torch.cuda.current_device()
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for value in values:
        found = staging_device(value)
        if found is not None:
            return found
    return None
