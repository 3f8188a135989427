"""Bucket transports from the trainer's process to vLLM's workers, and the worker side that opens them.

engine-core's :class:`~posttrain.core.weight_sync.BucketSender` packs the weight stream into one reusable byte
buffer. The transports here decide where that buffer lives and what goes through ``collective_rpc`` per bucket:

- ``inprocess``: the worker runs in this process (``external_launcher`` under torchrun, or
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The payload is the :class:`Bucket` itself: its tensors travel by
  reference, zero copy, on CPU or GPU.
- ``shm`` (CPU, worker in another process): the buffer is one POSIX shared-memory segment created once; the payload
  is pickled bytes holding the segment name and the tensor metadata. Tensors cannot be ``collective_rpc``
  arguments there: vLLM encodes them with msgpack and the worker receives ``[dtype, shape, index]`` lists.
- ``cuda_ipc`` (GPU, worker in another process): the buffer lives on the trainer's GPU and its CUDA IPC handle is
  exported once; the payload is pickled bytes holding the handle and the metadata. The receiver maps the same
  device memory, so the only copy is the receiver's own read.

The sender returns from ``send`` only after the worker has consumed the bucket (``collective_rpc`` is blocking),
so the next bucket can overwrite the buffer. :class:`BucketOpener` is the receiving half: it maps a payload's
buffer (once per segment or handle) and returns the :class:`Bucket`; checksums are verified by the
:class:`~posttrain.core.weight_sync.BucketReceiver` that consumes it.
"""

from __future__ import annotations

import mmap
import os
import pickle
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import torch

from posttrain.core.weight_sync import Bucket

Send = Callable[[Any], None]
"""Delivers one payload to every worker and returns when they have loaded it (a ``collective_rpc`` call)."""


class LocalBuffer:
    """``inprocess``: a plain tensor on the trainer's device; the payload is the bucket itself (by reference)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle: Any = None

    def payload(self, bucket: Bucket) -> Bucket:
        """The bucket itself: the worker reads the tensors on the same stream."""
        return bucket

    def close(self) -> None:
        """Nothing to unlink."""


class _SharedBuffer:
    """A buffer another process maps: the payload is pickled bytes holding its handle and the tensor metadata."""

    kind: str
    handle: Any

    def before_send(self) -> None:
        """Make the packed bytes visible to the other process."""

    def payload(self, bucket: Bucket) -> bytes:
        self.before_send()
        meta = {"kind": self.kind, "handle": self.handle, "metas": bucket.metas}
        return pickle.dumps({**meta, "index": bucket.index, "is_last": bucket.is_last})

    @staticmethod
    def key(handle: Any) -> Any:
        """What identifies the buffer across payloads (so the worker maps it once)."""
        return handle


class SharedMemoryBuffer(_SharedBuffer):
    """``shm`` (CPU, worker in another process): one POSIX shared-memory segment; the handle is its name."""

    kind = "shm"

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(
                f"the shm transport needs a CPU buffer device, got {device}: use cuda_ipc on GPU"
            )
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(create=True, size=nbytes)
        self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.handle: Any = self._shm.name

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    @staticmethod
    def open(name: str) -> tuple[torch.Tensor, mmap.mmap]:
        # Map /dev/shm/<name> directly rather than through SharedMemory: on Python < 3.13 attaching registers the
        # segment with this process's resource tracker, which then reports it leaked (and unlinks it) at exit.
        path = os.path.join("/dev/shm", name.lstrip("/"))
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"weight-sync shared-memory segment {path} does not exist (the trainer must "
                "run on the same host and keep the segment until the sync ends)"
            )
        with open(path, "r+b") as f:
            segment = mmap.mmap(f.fileno(), 0)
        return torch.frombuffer(segment, dtype=torch.uint8), segment


class CudaIpcBuffer(_SharedBuffer):
    """``cuda_ipc`` (GPU, worker in another process): a CUDA tensor whose IPC handle is exported once."""

    kind = "cuda_ipc"

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"the cuda_ipc transport needs a CUDA buffer device, got {device}: use shm on CPU"
            )
        from torch.multiprocessing.reductions import reduce_tensor

        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle: Any = reduce_tensor(self.tensor)[1]

    def before_send(self) -> None:
        """The worker reads on its own stream, in its own process: the packing must be done first."""
        torch.cuda.current_stream(self.tensor.device).synchronize()

    def close(self) -> None:
        """Nothing to unlink: the memory goes with the tensor."""

    @staticmethod
    def key(handle: tuple) -> Any:
        return handle[7]  # the IPC memory handle (bytes) names the allocation

    @staticmethod
    def open(handle: tuple) -> tuple[torch.Tensor, None]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*handle), None


BUFFERS: dict[str, type] = {"inprocess": LocalBuffer, "shm": SharedMemoryBuffer, "cuda_ipc": CudaIpcBuffer}
"""Transport name -> the buffer class that holds the bucket where the worker can read it."""
TRANSPORTS = tuple(BUFFERS)
SHARED = {name: cls for name, cls in BUFFERS.items() if issubclass(cls, _SharedBuffer)}


class RpcBucketTransport:
    """Owns the sender's bucket buffer and turns each bucket into a payload for ``send``."""

    def __init__(self, kind: str, bucket_bytes: int, device: torch.device | str, send: Send) -> None:
        if kind not in BUFFERS:
            raise ValueError(f"weight-sync transport {kind!r} is unknown: use one of {', '.join(TRANSPORTS)}")
        self.kind, self.send_payload = kind, send
        self._buffer = BUFFERS[kind](bucket_bytes, torch.device(device))
        self.buffer = self._buffer.tensor

    def send(self, bucket: Bucket) -> None:
        self.send_payload(self._buffer.payload(bucket))

    def close(self) -> None:
        """Free the buffer (unlinks the shared-memory segment)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._buffer.close()


class BucketOpener:
    """Worker side: payload -> :class:`Bucket`, mapping each shared buffer once until :meth:`close`."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._buffers: dict[Any, torch.Tensor] = {}

    def open(self, payload: Bucket | bytes) -> Bucket:
        if isinstance(payload, Bucket):
            return payload
        if not isinstance(payload, bytes):
            raise TypeError(
                f"weight-sync payload must be a Bucket or pickled bytes, got {type(payload).__name__}"
            )
        msg = pickle.loads(payload)
        return Bucket(self._buffer(msg["kind"], msg["handle"]), msg["metas"], msg["index"], msg["is_last"])

    def _buffer(self, kind: str, handle: Any) -> torch.Tensor:
        if kind not in SHARED:
            raise ValueError(f"weight-sync payload of unknown kind {kind!r}")
        key = (kind, SHARED[kind].key(handle))
        if key not in self._buffers:
            tensor, mapping = SHARED[kind].open(handle)
            self._buffers[key] = tensor
            if mapping is not None:
                self._maps.append(mapping)
        return self._buffers[key]

    def close(self) -> None:
        """Drop every mapping (the trainer may then free or reuse its buffers)."""
        self._buffers.clear()
        for segment in self._maps:
            try:
                segment.close()
            except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                pass
        self._maps.clear()
