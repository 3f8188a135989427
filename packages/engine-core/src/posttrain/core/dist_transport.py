"""Weight-sync buckets over torch.distributed point-to-point, between two processes on a private pair of
groups.

:func:`pair_group` builds a 2-member ``ProcessGroupGloo`` over its own ``TCPStore`` (:func:`pair_store`:
member 0 hosts it on a port the OS picks, member 1 connects to it). The group is never registered with
``torch.distributed``: the default process group of a torchrun trainer, if any, is neither needed nor touched,
and the group's traffic cannot interleave with the trainer's collectives. :func:`nccl_pair_group` builds a
2-member ``ProcessGroupNCCL`` over the same store (under a key prefix of its own) for members on two different
GPUs: NCCL moves the buckets' bytes from GPU to GPU (over NVLink where there is one); it refuses two members
on one GPU.

:class:`PairBucketTransport` is a :class:`~posttrain.core.weight_sync.BucketTransport`: ``send`` moves a
:class:`~posttrain.core.weight_sync.Bucket` as three messages (the sizes as an int64 pair and the pickled
header:
index, ``is_last``, metadata, extra, over the gloo group; then the used bytes of the buffer, over the NCCL
group when the transport has one, else over gloo). A gloo send returns once the peer received the data; an
NCCL send is queued on the GPU, ordered before anything later queued on the sender's current stream (the next
bucket's packing), and a receive is ordered before the receiver's later work (its checksums). ``recv``
rebuilds the bucket into a buffer it reuses (on the transport's device), so a bucket's tensors are valid until
the next ``recv``. The checksums travel in the metadata and are verified by the receiving
:class:`~posttrain.core.weight_sync.BucketReceiver`, not here.

With ``shared=True`` no bytes are sent: the sender packs into a buffer the receiver maps
(:mod:`posttrain.core.shared_buffer`: a shared-memory segment in host memory, or CUDA IPC between two
processes on one GPU, where NCCL cannot go), and the header carries its handle. The receiver reads the bucket
where it lies and calls ``release`` when done with it (``recv`` releases the previous bucket itself); the
sender's ``send`` returns only then, so the next bucket cannot overwrite bytes still being read.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .checksum import padded
from .shared_buffer import BufferMaps, CudaIpcBuffer, SharedMemoryBuffer
from .weight_sync import Bucket

_TAG_SIZES, _TAG_HEADER, _TAG_BYTES, _TAG_RELEASED = 1, 2, 3, 4


def pair_store(rank: int, port: int = 0, host: str = "127.0.0.1", timeout_s: float = 300.0) -> dist.TCPStore:
    """The rendezvous store of a pair: rank 0 hosts it (``port=0``: a free port the OS picks, read back from
    ``store.port`` and handed to rank 1) without waiting; rank 1 connects to ``host:port``."""
    if rank not in (0, 1):
        raise ValueError(f"pair_store rank={rank}: a pair has ranks 0 and 1")
    if rank == 1 and port == 0:
        raise ValueError("pair_store rank=1 needs the port rank 0's store listens on (store.port), not 0")
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, 2, rank == 0, timeout=timeout, wait_for_workers=False)


def pair_group(store: dist.TCPStore, rank: int, timeout_s: float = 300.0) -> dist.ProcessGroupGloo:
    """A 2-member gloo group over ``store``; blocks until the other member joined. A send or receive on it
    that waits longer than ``timeout_s`` raises instead of hanging."""
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))


def nccl_pair_group(store: dist.TCPStore, rank: int, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """A 2-member NCCL group over ``store`` (keys under the prefix ``nccl/``), for members on two different
    GPUs; each member calls it with its own GPU current (``torch.cuda.set_device``). The communicator is made
    at the first send or receive."""
    if not dist.is_nccl_available():
        raise ValueError("an NCCL weight-sync pair needs a torch built with NCCL (a CUDA build)")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, options)


class PairBucketTransport:
    """Sends buckets to, or receives them from, the other member of a pair: headers over the gloo ``group``,
    bytes over ``data`` (an :func:`nccl_pair_group`: CUDA buffers on both sides), or over gloo (CPU buffers),
    or not at all with ``shared`` (the sender's buffer is
    a :func:`~posttrain.core.shared_buffer.shared_buffer` given to :meth:`attach`; the receiver maps it on
    ``device``)."""

    def __init__(
        self,
        group: dist.ProcessGroupGloo,
        peer: int,
        data: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        shared: bool = False,
    ) -> None:
        self.group, self.peer, self.data, self.device = group, peer, data, torch.device(device)
        if shared and data is not None:
            raise ValueError(
                "a PairBucketTransport moves bytes over NCCL or through a shared buffer, not both"
            )
        if not shared and (data is None) != (self.device.type == "cpu"):
            raise ValueError(
                f"PairBucketTransport on {self.device} with{'out' if data is None else ''} an NCCL group: "
                "CPU buffers go over gloo (data=None), CUDA buffers over nccl_pair_group (or shared=True)"
            )
        self.shared = shared
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        """Receiving side: where buckets land, grown to the largest bucket yet (``send`` takes the sender's
        own buffer); with ``shared``, the sender's buffer as mapped here."""
        self._outgoing: Any = None  # sending side, shared: the buffer attach() gave
        self._maps = BufferMaps(self.device) if shared else None
        self._unreleased = False

    def attach(self, buffer: SharedMemoryBuffer | CudaIpcBuffer) -> torch.Tensor:
        """Sending side, ``shared``: pack buckets into ``buffer`` (build the sender with
        ``buffer.tensor``)."""
        if not self.shared:
            raise ValueError("attach() is for a PairBucketTransport built with shared=True")
        self._outgoing = buffer
        return buffer.tensor

    def send(self, bucket: Bucket) -> None:
        """Send ``bucket``; returns once the receiver is done with it (with ``shared``: once it called
        :meth:`release`, so the buffer may be overwritten)."""
        used = max((m.offset + padded(m.nbytes) for m in bucket.metas), default=0)  # with the zero tails
        handle = self._check_buffer(bucket, used)
        header = pickle.dumps((bucket.index, bucket.is_last, bucket.metas, bucket.extra, handle))
        self._send(torch.tensor([len(header), used], dtype=torch.int64), _TAG_SIZES)
        self._send(torch.frombuffer(bytearray(header), dtype=torch.uint8), _TAG_HEADER)
        if self.shared:
            self._recv(torch.empty(1, dtype=torch.int64), _TAG_RELEASED)
        elif used:
            self._send(bucket.buffer[:used], _TAG_BYTES, self.data)

    def _check_buffer(self, bucket: Bucket, used: int) -> tuple[str, Any] | None:
        """The shared buffer's (kind, handle) after making the packed bytes visible; checks that the bucket
        lies where the transport sends from."""
        if not used:
            return None
        buffer = bucket.buffer
        if self.shared:
            out = self._outgoing
            if out is None or buffer.data_ptr() != out.tensor.data_ptr():
                raise ValueError(
                    "this shared pair sends from the buffer given to attach(): build the BucketSender with "
                    "buffer=transport.attach(shared_buffer(...))"
                )
            out.before_send()
            return out.kind, out.handle
        want = "cpu" if self.data is None else "cuda"
        if buffer.device.type != want:
            raise ValueError(
                f"this pair sends {want} buffers, got one on {buffer.device}: build the BucketSender "
                f"with device={str(self.device)!r}"
            )
        return None

    def recv(self) -> Bucket:
        """The next bucket; its buffer is this transport's (or, with ``shared``, the sender's: call
        :meth:`release` once done with it), overwritten by the next bucket."""
        self.release()
        sizes = torch.empty(2, dtype=torch.int64)
        self._recv(sizes, _TAG_SIZES)
        header_len, used = sizes.tolist()
        header = torch.empty(header_len, dtype=torch.uint8)
        self._recv(header, _TAG_HEADER)
        index, is_last, metas, extra, handle = pickle.loads(header.numpy().tobytes())
        if self.shared:
            self._unreleased = True
            if handle is not None:
                self.buffer = self._maps.open(*handle)
            return Bucket(self.buffer[:used], metas, index, is_last, extra)
        if used > self.buffer.numel():
            self.buffer = torch.empty(used, dtype=torch.uint8, device=self.device)
        if used:
            self._recv(self.buffer[:used], _TAG_BYTES, self.data)
        return Bucket(self.buffer[:used], metas, index, is_last, extra)

    def release(self) -> None:
        """Receiving side, ``shared``: done with the last bucket (its reads finished on this process's GPU
        stream); the sender may overwrite it. Does nothing otherwise, or when already released."""
        if not self._unreleased:
            return
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self._unreleased = False
        self._send(torch.zeros(1, dtype=torch.int64), _TAG_RELEASED)

    def close(self) -> None:
        """Receiving side: drop the mapped shared buffers."""
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        if self._maps is not None:
            self._maps.close()

    def _send(self, tensor: torch.Tensor, tag: int, group: dist.ProcessGroup | None = None) -> None:
        (group or self.group).send([tensor.contiguous()], self.peer, tag).wait()

    def _recv(self, tensor: torch.Tensor, tag: int, group: dist.ProcessGroup | None = None) -> None:
        (group or self.group).recv([tensor], self.peer, tag).wait()
