"""Bucket transports from the trainer's process to vLLM's workers, and the worker side that opens them.

engine-core's :class:`~posttrain.core.weight_sync.BucketSender` packs the weight stream into one reusable byte
buffer. The transports here decide where that buffer lives and what goes through ``collective_rpc`` per
bucket:

- ``inprocess``: the worker runs in this process (``external_launcher`` under torchrun, or
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The payload is the :class:`Bucket` itself: its tensors travel by
  reference, zero copy, on CPU or GPU.
- ``shm`` (CPU, worker in another process): the buffer is one POSIX shared-memory segment created once; the
  payload is pickled bytes holding the segment name and the tensor metadata. Tensors cannot be
  ``collective_rpc`` arguments there: vLLM encodes them with msgpack and the worker receives
  ``[dtype, shape, index]`` lists.
- ``cuda_ipc`` (GPU, worker in another process): the buffer lives on the trainer's GPU and its CUDA IPC handle
  is exported once; the payload is pickled bytes holding the handle and the metadata. The receiver maps the
  same device memory, so the only copy is the receiver's own read.

The sender returns from ``send`` only after the worker has consumed the bucket (``collective_rpc`` is
blocking), so the next bucket can overwrite the buffer. :class:`BucketOpener` is the receiving half: it maps a
payload's buffer (once per segment or handle) and returns the :class:`Bucket`; checksums are verified by the
:class:`~posttrain.core.weight_sync.BucketReceiver` that consumes it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from posttrain.core.shared_buffer import SHARED_BUFFERS, BufferMaps, CudaIpcBuffer, SharedMemoryBuffer
from posttrain.core.weight_sync import Bucket

Send = Callable[[Any], None]
"""Delivers one payload to every worker and returns when they have loaded it (a ``collective_rpc`` call)."""


class LocalBuffer:
    """``inprocess``: a plain tensor on the trainer's device; the payload is the bucket itself (by
    reference)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle: Any = None

    def payload(self, bucket: Bucket) -> Bucket:
        """The bucket itself: the worker reads the tensors on the same stream."""
        return bucket

    def close(self) -> None:
        """Nothing to unlink."""


def _payload(buffer: SharedMemoryBuffer | CudaIpcBuffer, bucket: Bucket) -> bytes:
    """What goes through ``collective_rpc`` for a bucket in a shared buffer: pickled bytes holding the
    buffer's kind and handle and the tensor metadata (the packed bytes made visible to the other process
    first)."""
    buffer.before_send()
    meta = {"kind": buffer.kind, "handle": buffer.handle, "metas": bucket.metas}
    return pickle.dumps({**meta, "index": bucket.index, "is_last": bucket.is_last})


BUFFERS: dict[str, type] = {"inprocess": LocalBuffer, **SHARED_BUFFERS}
"""Transport name -> the buffer class that holds the bucket where the worker can read it."""
TRANSPORTS = tuple(BUFFERS)


class RpcBucketTransport:
    """Owns the sender's bucket buffer and turns each bucket into a payload for ``send``."""

    def __init__(self, kind: str, bucket_bytes: int, device: torch.device | str, send: Send) -> None:
        if kind not in BUFFERS:
            raise ValueError(f"weight-sync transport {kind!r} is unknown: use one of {', '.join(TRANSPORTS)}")
        self.kind, self.send_payload = kind, send
        self._buffer = BUFFERS[kind](bucket_bytes, torch.device(device))
        self.buffer = self._buffer.tensor

    def send(self, bucket: Bucket) -> None:
        shared = self.kind in SHARED_BUFFERS
        self.send_payload(_payload(self._buffer, bucket) if shared else self._buffer.payload(bucket))

    def close(self) -> None:
        """Free the buffer (unlinks the shared-memory segment)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._buffer.close()


class BucketOpener:
    """Worker side: payload -> :class:`Bucket`, mapping each shared buffer once until :meth:`close`."""

    def __init__(self) -> None:
        self._maps = BufferMaps()

    def open(self, payload: Bucket | bytes) -> Bucket:
        if isinstance(payload, Bucket):
            return payload
        if not isinstance(payload, bytes):
            raise TypeError(
                f"weight-sync payload must be a Bucket or pickled bytes, got {type(payload).__name__}"
            )
        msg = pickle.loads(payload)
        buffer = self._maps.open(msg["kind"], msg["handle"])
        return Bucket(buffer, msg["metas"], msg["index"], msg["is_last"])

    def close(self) -> None:
        """Drop every mapping (the trainer may then free or reuse its buffers)."""
        self._maps.close()
