"""Bucket buffers another process on the same host maps, so a weight-sync bucket crosses with no copy in
between.

The sender packs a bucket into one buffer created once; a handle to it travels (pickled) to the receiver,
which maps the same memory once and reads the bucket where it lies:

- :class:`SharedMemoryBuffer` (``shm``, host memory): one POSIX shared-memory segment; the handle is its name.
- :class:`CudaIpcBuffer` (``cuda_ipc``, GPU memory): a CUDA tensor whose IPC handle (torch's own
  ``reduce_tensor``) is exported once. The receiver opens it on its own numbering of the same GPU (a process
  that sees one GPU calls it ``cuda:0`` whatever the sender calls it).

Neither buffer says when the receiver is done with a bucket: the transport that uses one must (the sender may
overwrite the buffer only then). :class:`BufferMaps` is the receiving half: it maps each handle once.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import shared_memory
from typing import Any

import torch

__all__ = ["SHARED_BUFFERS", "BufferMaps", "CudaIpcBuffer", "SharedMemoryBuffer", "shared_buffer"]


class SharedMemoryBuffer:
    """``shm``: one POSIX shared-memory segment of ``nbytes``; ``handle`` is its name."""

    kind = "shm"

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"the shm transport needs a CPU buffer device, got {device}: use cuda_ipc on GPU"
            )
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(create=True, size=nbytes)
        self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.handle: Any = self._shm.name

    def before_send(self) -> None:
        """Host memory: the packed bytes are already visible to the other process."""

    def close(self) -> None:
        """Unlink the segment (mappings the receiver still holds stay valid until it drops them)."""
        if self._shm is not None:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            try:
                self._shm.close()
            except BufferError:  # a view of the buffer is still alive; the mapping goes with it
                pass
            self._shm.unlink()
            self._shm = None

    @staticmethod
    def key(handle: Any) -> Any:
        """What names the buffer across payloads (so the receiver maps it once)."""
        return handle

    @staticmethod
    def open(handle: str, device: torch.device | str | None = None) -> tuple[torch.Tensor, mmap.mmap]:
        """The segment ``handle`` as a uint8 tensor, and the mapping to close when done."""
        # Map /dev/shm/<name> directly rather than through SharedMemory: on Python < 3.13 attaching registers
        # the segment with this process's resource tracker, which then reports it leaked (and unlinks it) at
        # exit.
        path = os.path.join("/dev/shm", handle.lstrip("/"))
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"weight-sync shared-memory segment {path} does not exist (the sender must "
                "run on the same host and keep the segment until the sync ends)"
            )
        with open(path, "r+b") as f:
            segment = mmap.mmap(f.fileno(), 0)
        return torch.frombuffer(segment, dtype=torch.uint8), segment


_DEVICE_ARG = 6  # torch.multiprocessing.reductions.rebuild_cuda_tensor's storage_device argument
_HANDLE_ARG = 7  # its storage_handle: the IPC memory handle that names the allocation


class CudaIpcBuffer:
    """``cuda_ipc``: a CUDA tensor of ``nbytes`` on ``device`` whose IPC handle is exported once."""

    kind = "cuda_ipc"

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError(
                f"the cuda_ipc transport needs a CUDA buffer device, got {device}: use shm on CPU"
            )
        from torch.multiprocessing.reductions import reduce_tensor

        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle: Any = reduce_tensor(self.tensor)[1]

    def before_send(self) -> None:
        """The receiver reads on its own stream, in its own process: the packing must be done first."""
        torch.cuda.current_stream(self.tensor.device).synchronize()

    def close(self) -> None:
        """Nothing to unlink: the memory goes with the tensor."""

    @staticmethod
    def key(handle: tuple) -> Any:
        return handle[_HANDLE_ARG]

    @staticmethod
    def open(handle: tuple, device: torch.device | str | None = None) -> tuple[torch.Tensor, None]:
        """The buffer, mapped on ``device`` (this process's name for the sender's GPU; default: the sender's
        index, right when both processes see the same GPUs)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(handle)
        if device is not None:
            device = torch.device(device)
            args[_DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
        return rebuild_cuda_tensor(*args), None


SHARED_BUFFERS: dict[str, type[SharedMemoryBuffer] | type[CudaIpcBuffer]] = {
    "shm": SharedMemoryBuffer,
    "cuda_ipc": CudaIpcBuffer,
}
"""Kind -> the buffer class."""


def shared_buffer(nbytes: int, device: torch.device | str) -> SharedMemoryBuffer | CudaIpcBuffer:
    """The shared buffer for ``device``: CUDA IPC on a GPU, a shared-memory segment on the CPU."""
    if torch.device(device).type == "cuda":
        return CudaIpcBuffer(nbytes, device)
    return SharedMemoryBuffer(nbytes, device)


class BufferMaps:
    """The receiving half: ``(kind, handle)`` -> the mapped buffer, each mapped once until :meth:`close`;
    ``device``: where CUDA buffers open (this process's name for the sender's GPU)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self._maps: list[mmap.mmap] = []
        self._buffers: dict[Any, torch.Tensor] = {}

    def open(self, kind: str, handle: Any) -> torch.Tensor:
        if kind not in SHARED_BUFFERS:
            raise ValueError(
                f"weight-sync buffer of unknown kind {kind!r}: expected one of {', '.join(SHARED_BUFFERS)}"
            )
        cls = SHARED_BUFFERS[kind]
        key = (kind, cls.key(handle))
        if key not in self._buffers:
            tensor, mapping = cls.open(handle, self.device)
            self._buffers[key] = tensor
            if mapping is not None:
                self._maps.append(mapping)
        return self._buffers[key]

    def close(self) -> None:
        """Drop every mapping (the sender may then free or reuse its buffers)."""
        self._buffers.clear()
        for segment in self._maps:
            try:
                segment.close()
            except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                pass
        self._maps.clear()
