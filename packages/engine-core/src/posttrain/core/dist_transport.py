"""Weight-sync buckets over torch.distributed point-to-point, between two processes on a private pair of groups.

:func:`pair_group` builds a 2-member ``ProcessGroupGloo`` over its own ``TCPStore`` (:func:`pair_store`: member 0
hosts it on a port the OS picks, member 1 connects to it). The group is never registered with ``torch.distributed``: the
default process group of a torchrun trainer, if any, is neither needed nor touched, and the group's traffic
cannot interleave with the trainer's collectives. :func:`nccl_pair_group` builds a 2-member ``ProcessGroupNCCL``
over the same store (under a key prefix of its own) for members on two different GPUs: NCCL moves the buckets'
bytes from GPU to GPU (over NVLink where there is one); it refuses two members on one GPU.

:class:`PairBucketTransport` is a :class:`~posttrain.core.weight_sync.BucketTransport`: ``send`` moves a
:class:`~posttrain.core.weight_sync.Bucket` as three messages (the sizes as an int64 pair and the pickled header:
index, ``is_last``, metadata, extra, over the gloo group; then the used bytes of the buffer, over the NCCL group
when the transport has one, else over gloo). A gloo send returns once the peer received the data; an NCCL send
is queued on the GPU, ordered before anything later queued on the sender's current stream (the next bucket's
packing), and a receive is ordered before the receiver's later work (its checksums). ``recv`` rebuilds the bucket
into a buffer it reuses (on the transport's device), so a bucket's tensors are valid until the next ``recv``. The
checksums travel in the metadata and are verified by the receiving
:class:`~posttrain.core.weight_sync.BucketReceiver`, not here.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from .checksum import padded
from .weight_sync import Bucket

_TAG_SIZES, _TAG_HEADER, _TAG_BYTES = 1, 2, 3


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
    """A 2-member NCCL group over ``store`` (keys under the prefix ``nccl/``), for members on two different GPUs;
    each member calls it with its own GPU current (``torch.cuda.set_device``). The communicator is made at the
    first send or receive."""
    if not dist.is_nccl_available():
        raise ValueError("an NCCL weight-sync pair needs a torch built with NCCL (a CUDA build)")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, 2, options)


class PairBucketTransport:
    """Sends buckets to, or receives them from, the other member of a pair: headers over the gloo ``group``,
    bytes over ``data`` (an :func:`nccl_pair_group`: CUDA buffers on both sides) or, without it, over gloo (CPU
    buffers)."""

    def __init__(
        self,
        group: dist.ProcessGroupGloo,
        peer: int,
        data: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.group, self.peer, self.data, self.device = group, peer, data, torch.device(device)
        if (data is None) != (self.device.type == "cpu"):
            raise ValueError(
                f"PairBucketTransport on {self.device} with{'out' if data is None else ''} an NCCL group: CPU "
                "buffers go over gloo (data=None), CUDA buffers over nccl_pair_group"
            )
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        """Receiving side: where buckets land, grown to the largest bucket yet (``send`` takes the sender's own
        buffer)."""

    def send(self, bucket: Bucket) -> None:
        want = "cpu" if self.data is None else "cuda"
        if bucket.buffer.device.type != want and bucket.buffer.numel():
            raise ValueError(
                f"this pair sends {want} buffers, got one on {bucket.buffer.device}: build the BucketSender "
                f"with device={str(self.device)!r}"
            )
        used = max((m.offset + padded(m.nbytes) for m in bucket.metas), default=0)  # with the zero tails
        header = pickle.dumps((bucket.index, bucket.is_last, bucket.metas, bucket.extra))
        self._send(torch.tensor([len(header), used], dtype=torch.int64), _TAG_SIZES)
        self._send(torch.frombuffer(bytearray(header), dtype=torch.uint8), _TAG_HEADER)
        if used:
            self._send(bucket.buffer[:used], _TAG_BYTES, self.data)

    def recv(self) -> Bucket:
        """The next bucket; its buffer is this transport's, overwritten by the next ``recv``."""
        sizes = torch.empty(2, dtype=torch.int64)
        self._recv(sizes, _TAG_SIZES)
        header_len, used = sizes.tolist()
        header = torch.empty(header_len, dtype=torch.uint8)
        self._recv(header, _TAG_HEADER)
        index, is_last, metas, extra = pickle.loads(header.numpy().tobytes())
        if used > self.buffer.numel():
            self.buffer = torch.empty(used, dtype=torch.uint8, device=self.device)
        if used:
            self._recv(self.buffer[:used], _TAG_BYTES, self.data)
        return Bucket(self.buffer[:used], metas, index, is_last, extra)

    def _send(self, tensor: torch.Tensor, tag: int, group: dist.ProcessGroup | None = None) -> None:
        (group or self.group).send([tensor.contiguous()], self.peer, tag).wait()

    def _recv(self, tensor: torch.Tensor, tag: int, group: dist.ProcessGroup | None = None) -> None:
        (group or self.group).recv([tensor], self.peer, tag).wait()
