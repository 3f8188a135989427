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

TRANSPORTS = ("inprocess", "shm", "cuda_ipc")

Send = Callable[[Any], None]
"""Delivers one payload to every worker and returns when they have loaded it (a ``collective_rpc`` call)."""


class RpcBucketTransport:
    """Owns the sender's bucket buffer and turns each bucket into a payload for ``send``."""

    def __init__(self, kind: str, bucket_bytes: int, device: torch.device | str, send: Send) -> None:
        if kind not in TRANSPORTS:
            raise ValueError(f"weight-sync transport {kind!r} is unknown: use one of {', '.join(TRANSPORTS)}")
        device = torch.device(device)
        if kind == "cuda_ipc" and device.type != "cuda":
            raise ValueError(
                f"the cuda_ipc transport needs a CUDA buffer device, got {device}: use shm on CPU"
            )
        if kind == "shm" and device.type != "cpu":
            raise ValueError(
                f"the shm transport needs a CPU buffer device, got {device}: use cuda_ipc on GPU"
            )
        self.kind, self.send_payload = kind, send
        self._shm: shared_memory.SharedMemory | None = None
        self._handle: Any = None
        if kind == "shm":
            self._shm = shared_memory.SharedMemory(create=True, size=bucket_bytes)
            self.buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=bucket_bytes)
            self._handle = self._shm.name
        else:
            self.buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
            if kind == "cuda_ipc":
                from torch.multiprocessing.reductions import reduce_tensor

                self._handle = reduce_tensor(self.buffer)[1]

    def send(self, bucket: Bucket) -> None:
        if self.kind == "inprocess":
            self.send_payload(bucket)
            return
        if self.kind == "cuda_ipc":
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self.send_payload(
            pickle.dumps(
                {
                    "kind": self.kind,
                    "handle": self._handle,
                    "metas": bucket.metas,
                    "index": bucket.index,
                    "is_last": bucket.is_last,
                }
            )
        )

    def close(self) -> None:
        """Free the buffer (unlinks the shared-memory segment)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._handle = None
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None


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
        # A segment is named by its path; a CUDA buffer by its IPC memory handle (bytes, field 7).
        key = (kind, handle if kind == "shm" else handle[7])
        if key not in self._buffers:
            if kind == "shm":
                self._buffers[key] = self._map_segment(handle)
            elif kind == "cuda_ipc":
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                self._buffers[key] = rebuild_cuda_tensor(*handle)
            else:
                raise ValueError(f"weight-sync payload of unknown kind {kind!r}")
        return self._buffers[key]

    def _map_segment(self, name: str) -> torch.Tensor:
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
        self._maps.append(segment)
        return torch.frombuffer(segment, dtype=torch.uint8)

    def close(self) -> None:
        """Drop every mapping (the trainer may then free or reuse its buffers)."""
        self._buffers.clear()
        for segment in self._maps:
            try:
                segment.close()
            except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                pass
        self._maps.clear()
