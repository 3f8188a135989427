"""Bucketed weight-sync protocol between a trainer and a rollout.

The sender casts each (name, tensor) to the rollout dtype and packs it into a flat byte bucket of a fixed
size.
When the next tensor does not fit, the bucket goes out with its metadata (name, shape, dtype, offset, nbytes
and a checksum of the tensor's bytes); the receiver rebuilds views of the bucket and verifies every checksum
before handing tensors on. A transport only moves ``(buffer, metadata)``: in-process here, CUDA IPC or shared
memory in the rollout packages. The checksum (:mod:`.checksum`) is a position-weighted sum of 256-byte row
hashes, so a swapped, stale or truncated tensor fails loudly.

Both sides compute a bucket's checksums in one pass over the bucket (:func:`bucket_checksums`), not one
reduction per tensor: a 1.5B model is 338 tensors, and per-tensor reductions cost thousands of kernel launches
a sync.
The sender places each tensor at a multiple of 256 bytes and copies it there cast to the rollout dtype (no
temporary in the rollout dtype; the stream may come in the trainer's stored dtype). The copies are batched:
the sender holds up to ``copy_group_bytes`` of the stream's tensors and copies them with one
``torch._foreach_copy_`` (on CUDA one multi-tensor kernel, with the cast, for tensors of one source dtype and
layout), so the host cost is not one ``copy_`` dispatch per tensor. Before a bucket's checksums, one indexed
fill zeroes the bytes from each tensor's end to the next multiple of 256 (the index is cached per layout), so
a tensor's rows inside the bucket are the ones :func:`tensor_checksum` reads whatever the buffer held before
(the previous bucket of the same sync, which shares the buffer, or another layout).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .checksum import ROW, WeightSyncError, bucket_checksums, padded, tensor_checksum, tensor_checksums
from .rollout import SyncReport

__all__ = [
    "Bucket",
    "BucketReceiver",
    "BucketSender",
    "BucketTransport",
    "InProcessTransport",
    "TensorMeta",
    "WeightSyncError",
    "bucket_checksums",
    "tensor_checksum",
    "tensor_checksums",
    "unpack_bucket",
]


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits inside a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    checksum: int


@dataclass
class Bucket:
    """A flat uint8 buffer and the tensors packed in it."""

    buffer: torch.Tensor
    metas: list[TensorMeta]
    index: int
    is_last: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class BucketTransport(Protocol):
    """Moves a bucket from the trainer to the rollout; returns after the receiver has consumed it."""

    def send(self, bucket: Bucket) -> None: ...


class InProcessTransport:
    """Hands each bucket to a callable in the same process (the HF rollout, tests)."""

    def __init__(self, receive: Callable[[Bucket], None]) -> None:
        self.receive = receive

    def send(self, bucket: Bucket) -> None:
        self.receive(bucket)


_MAX_TARGETS = 1 << 16
"""The most buffer views a :class:`BucketSender` keeps (a model's tensors, base and adapter, are far
fewer)."""
_MAX_LAYOUTS = 64
"""The most bucket layouts whose padding index a :class:`BucketSender` keeps."""
COPY_GROUP_BYTES = 256 << 20
"""How many bytes of the stream's tensors a :class:`BucketSender` holds before copying them into the bucket:
the extra memory a stream of freshly gathered tensors (multi-rank FSDP) keeps alive, one multi-tensor copy per
group."""


class _CopyGroup:
    """Copies pending for the bucket: (buffer view, source) pairs of one source dtype and device and one
    target dtype, run by :meth:`run` with one ``torch._foreach_copy_``. Its CUDA kernel takes one multi-tensor
    launch (casting) when sources share dtype and device and match their targets' strides, else it copies
    tensor by tensor in C++; some torch versions check only the sources' dtype there and dispatch on the first
    target's, so a group also keeps one target dtype."""

    def __init__(self, limit: int, non_blocking: bool) -> None:
        self.limit, self.non_blocking = limit, non_blocking
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.key: tuple | None = None
        self.held = 0

    def add(self, target: torch.Tensor, source: torch.Tensor) -> None:
        key = (source.dtype, source.device, target.dtype)
        if key != self.key:
            self.run()
            self.key = key
        self.targets.append(target)
        self.sources.append(source)
        self.held += source.numel() * source.element_size()
        if self.held >= self.limit:
            self.run()

    def run(self) -> None:
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources, non_blocking=self.non_blocking)
        self.targets, self.sources, self.key, self.held = [], [], None, 0


def _pack(buffer: torch.Tensor, offset: int, tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Copy ``tensor`` into ``buffer`` at ``offset`` as ``dtype`` (cast and copy in one kernel, from any
    device, no host sync into a CUDA buffer) and zero the bytes up to the next checksum row; returns the bytes
    written."""
    nbytes = tensor.numel() * dtype.itemsize
    target = buffer[offset : offset + nbytes].view(dtype).view(tensor.shape)
    target.copy_(tensor, non_blocking=buffer.is_cuda)
    if nbytes % ROW:
        buffer[offset + nbytes : offset + padded(nbytes)].zero_()
    return nbytes


class BucketSender:
    """Packs a (name, tensor) stream into buckets of ``bucket_bytes`` and sends them."""

    def __init__(
        self,
        transport: BucketTransport,
        bucket_bytes: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        buffer: torch.Tensor | None = None,
        copy_group_bytes: int = COPY_GROUP_BYTES,
    ) -> None:
        if bucket_bytes < ROW:
            raise ValueError(
                f"bucket size {bucket_bytes} bytes is less than one {ROW}-byte checksum row: use at least "
                f"{ROW}"
            )
        if buffer is not None and (
            buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < bucket_bytes
        ):
            raise ValueError(
                f"bucket buffer must be a 1-D uint8 tensor of at least {bucket_bytes} bytes, got "
                f"{buffer.dtype} of shape {tuple(buffer.shape)}"
            )
        if copy_group_bytes < 1:
            raise ValueError(f"copy_group_bytes must be positive, got {copy_group_bytes}")
        self.transport, self.bucket_bytes, self.dtype = transport, bucket_bytes, dtype
        self.copy_group_bytes = copy_group_bytes
        # A transport may own the buffer (shared memory, CUDA IPC) so the receiver reads it where it lies.
        self.buffer = (
            buffer if buffer is not None else torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        )
        self._targets: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        """Views of :attr:`buffer` by (offset, dtype, shape): a sender kept across syncs packs the same layout
        again without building three views per tensor each time (a 1.5B model is 338 tensors)."""
        self._paddings: dict[tuple[tuple[int, int], ...], torch.Tensor | None] = {}
        """Bucket layout (offset, nbytes of each tensor) -> the byte positions of its padding, on the buffer's
        device (None: no padding)."""

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Send every tensor; the last bucket is flagged ``is_last``. Returns counts and timings. Tensors are
        copied into the bucket in groups of up to ``copy_group_bytes`` (a tensor of the stream must stay
        unchanged until the stream yields the next few: the engines' streams yield each tensor once, freshly
        gathered or a view of the stored weight); a bucket's checksums are computed from the bucket itself
        when it goes out, with one host sync per bucket."""
        start = time.perf_counter()
        report = SyncReport()
        pending: list[tuple[str, tuple[int, ...], torch.dtype, int, int]] = []
        copies = _CopyGroup(self.copy_group_bytes, non_blocking=self.buffer.is_cuda)
        offset = 0
        with torch.no_grad():  # a source that requires grad must not make the buffer part of a graph
            for name, tensor in weights:
                dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
                shape = tuple(tensor.shape)
                nbytes = tensor.numel() * dtype.itemsize
                if padded(nbytes) > self.bucket_bytes:
                    raise ValueError(
                        f"tensor {name!r} has {nbytes} bytes ({nbytes / 2**20:.1f} MiB), more than the "
                        f"weight-sync bucket's {self.bucket_bytes} bytes: raise "
                        f"rollout.update_weights_bucket_megabytes to at least {padded(nbytes) // 2**20 + 1}"
                    )
                if offset + padded(nbytes) > self.bucket_bytes:
                    self._flush(pending, copies, report, is_last=False)
                    pending, offset = [], 0
                copies.add(self._target(offset, dtype, shape), tensor)
                pending.append((name, shape, dtype, offset, nbytes))
                offset += padded(nbytes)
                report.num_tensors += 1
                report.num_bytes += nbytes
            self._flush(pending, copies, report, is_last=True)
        report.seconds = time.perf_counter() - start
        return report

    def _target(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The view of the buffer a tensor of ``shape`` and ``dtype`` is packed into at ``offset``
        (cached)."""
        key = (offset, dtype, shape)
        view = self._targets.get(key)
        if view is None:
            if len(self._targets) >= _MAX_TARGETS:  # layouts keep changing: do not hold views without bound
                self._targets.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            view = self._targets[key] = self.buffer[offset : offset + nbytes].view(dtype).view(shape)
        return view

    def _padding(self, spans: tuple[tuple[int, int], ...]) -> torch.Tensor | None:
        """The byte positions from each span's end to the next multiple of :data:`ROW` (cached per layout)."""
        if spans not in self._paddings:
            if len(self._paddings) >= _MAX_LAYOUTS:
                self._paddings.clear()
            gaps = [torch.arange(o + n, o + padded(n)) for o, n in spans if n % ROW]
            self._paddings[spans] = torch.cat(gaps).to(self.buffer.device) if gaps else None
        return self._paddings[spans]

    def _flush(self, pending: list[tuple], copies: _CopyGroup, report: SyncReport, is_last: bool) -> None:
        """Finish the bucket's copies, zero its padding, checksum it and send it."""
        copies.run()
        spans = tuple((off, nbytes) for _, _, _, off, nbytes in pending)
        padding = self._padding(spans)
        if padding is not None:
            self.buffer.index_fill_(0, padding, 0)
        sums = bucket_checksums(self.buffer, list(spans))
        metas = [TensorMeta(*entry, checksum) for entry, checksum in zip(pending, sums)]
        self.transport.send(Bucket(self.buffer, metas, report.num_buckets, is_last))
        report.num_buckets += 1


def unpack_bucket(
    bucket: Bucket, verify: bool = True, clone: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Views (or clones) of the tensors in ``bucket``; with ``verify`` every checksum is checked (one host
    sync for the bucket) before the first tensor is handed out. Each view is one ``as_strided`` of the buffer
    viewed as its dtype (one such view per dtype and bucket), not a slice and two views per tensor."""
    views, typed = [], {}
    for meta in bucket.metas:
        end = meta.offset + meta.nbytes
        if end > bucket.buffer.numel() or meta.offset % ROW:
            raise WeightSyncError(
                f"bucket {bucket.index}: tensor {meta.name!r} at bytes {meta.offset}..{end} is not inside "
                f"the buffer's {bucket.buffer.numel()} bytes at a multiple of {ROW} (partial or damaged "
                "transfer)"
            )
        flat = typed.get(meta.dtype)
        if flat is None:
            usable = bucket.buffer.numel() // meta.dtype.itemsize * meta.dtype.itemsize
            flat = typed[meta.dtype] = bucket.buffer[:usable].view(meta.dtype)
        start = flat.storage_offset() + meta.offset // meta.dtype.itemsize
        views.append(flat.as_strided(meta.shape, _contiguous_strides(meta.shape), start))
    if verify:
        sums = bucket_checksums(bucket.buffer, [(m.offset, m.nbytes) for m in bucket.metas])
        for meta, got in zip(bucket.metas, sums):
            if got != meta.checksum:
                raise WeightSyncError(
                    f"bucket {bucket.index}: checksum mismatch for {meta.name!r} (sent "
                    f"{meta.checksum}, received {got}); the rollout's weights are not updated"
                )
    for meta, tensor in zip(bucket.metas, views):
        yield meta.name, tensor.clone() if clone else tensor


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class BucketReceiver:
    """Verifies buckets and feeds their tensors to ``load``; knows when a sync is complete."""

    def __init__(self, load: Callable[[list[tuple[str, torch.Tensor]]], None], verify: bool = True) -> None:
        self.load, self.verify = load, verify
        self.expected_index = 0
        self.complete = False
        self.num_tensors = 0

    def __call__(self, bucket: Bucket) -> None:
        if bucket.index != self.expected_index:
            raise WeightSyncError(
                f"bucket {bucket.index} arrived, expected bucket {self.expected_index} (lost or "
                "reordered bucket)"
            )
        tensors = list(unpack_bucket(bucket, verify=self.verify))
        self.load(tensors)
        self.num_tensors += len(tensors)
        self.expected_index += 1
        self.complete = bucket.is_last

    def finish(self) -> int:
        """Raise unless the last bucket arrived; return the number of tensors loaded and reset."""
        if not self.complete:
            raise WeightSyncError(
                f"weight sync incomplete: {self.expected_index} bucket(s) received and none was flagged last"
            )
        n = self.num_tensors
        self.expected_index, self.complete, self.num_tensors = 0, False, 0
        return n
