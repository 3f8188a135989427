"""Host staging for a synchronous DCP save of device tensors: reused page-locked buffers instead of fresh memory.

DCP's writer threads copy each device tensor to the host with ``tensor.cpu()`` just before writing it: a new
pageable allocation per tensor (page faults on every page, then freed again) and a pageable device-to-host copy
(~18 GB/s on an H200 host, against ~55 GB/s into page-locked memory). On the GPU machine that made a sync save of
the 1.5B model with AdamW state (18.5 GB) take 18 s, while the async save's write of the same bytes from
page-locked host buffers took 9 s.

:class:`StagingSavePlanner` is DCP's default planner with one change: a tensor that is not on the host is copied
into a page-locked buffer taken from a :class:`StagingPool` and handed to the writer as a host tensor whose
storage is exactly its bytes (so DCP neither clones nor re-copies it). The buffer returns to the pool when the
writer drops the last reference to that tensor, so the pool holds only what is in flight: two tensors per writer
thread (the one being written and the next; DCP hands each thread its tensors largest first, so later ones reuse
the first buffers), for the 1.5B model a few GB, not a copy of the whole state as an async snapshot is. The pool
lives for one save; nothing is kept between saves.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from .pinned import host_empty


class StagingPool:
    """Page-locked host buffers (raw bytes) lent out for one tensor at a time; thread-safe."""

    def __init__(self, pin_device: int | None) -> None:
        self.pin_device = pin_device
        """CUDA device the buffers are registered for (None: plain host memory, as in CPU tests)."""
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.held_bytes = 0
        """Bytes of the buffers the pool holds now, lent out or free."""
        self.peak_bytes = 0
        """The most ``held_bytes`` has been: the pool's host footprint."""
        self.allocations = 0
        """How many buffers were allocated (a reused buffer is not counted again)."""

    def stage(self, src: torch.Tensor) -> torch.Tensor:
        """A host tensor equal to ``src`` (same shape and dtype, contiguous) that owns exactly its bytes; its
        buffer goes back to the pool once no tensor refers to that storage any more."""
        if src.numel() == 0:
            return torch.empty(src.shape, dtype=src.dtype)
        nbytes = src.numel() * src.element_size()
        buf = self._take(nbytes)
        dst = buf[:nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src.detach())  # synchronous: the bytes are on the host when this returns
        window = buf[:nbytes].numpy()  # a new array object: alive exactly as long as the storage below
        weakref.finalize(window, self._give_back, buf)
        return torch.frombuffer(window, dtype=src.dtype, count=src.numel()).view(src.shape)

    def _take(self, nbytes: int) -> torch.Tensor:
        """The smallest free buffer of at least ``nbytes``; else a new one, after dropping the free buffers
        (all too small) so that the footprint stays what is in flight."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf
            self.held_bytes += nbytes - sum(b.numel() for b in self._free)
            self._free.clear()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.allocations += 1
        return host_empty((nbytes,), torch.uint8, self.pin_device)

    def _give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class StagingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that hands device tensors to the writer through a :class:`StagingPool`."""

    def __init__(self, pool: StagingPool) -> None:
        super().__init__()
        self.pool = pool

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            return self.pool.stage(data)
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
