"""Bucketed weight-sync protocol between a trainer and a rollout.

The sender casts each (name, tensor) to the rollout dtype and packs it into a flat byte bucket of a fixed size.
When the next tensor does not fit, the bucket goes out with its metadata (name, shape, dtype, offset, nbytes and
a checksum of the tensor's bytes); the receiver rebuilds views of the bucket and verifies every checksum before
handing tensors on. A transport only moves ``(buffer, metadata)``: in-process here, CUDA IPC or shared memory in
the rollout packages. The checksum is a position-weighted sum of the bytes read as int32 words, so a swapped,
stale or truncated tensor fails loudly.

Both sides compute a bucket's checksums in one pass over the bucket (:func:`bucket_checksums`: two running sums
over the whole buffer, read at every tensor's first and last word), not one reduction per tensor: a 1.5B model
is 338 tensors, and per-tensor reductions cost thousands of kernel launches a sync. The sender packs each tensor
with one copy that also casts it (no temporary in the rollout dtype) and zeroes the bytes from its end to the
next 4-byte boundary, so a tensor's words inside the bucket are the ones :func:`tensor_checksum` reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .rollout import SyncReport

_CHUNK_WORDS = 1 << 26
_SCAN_WORDS = 1 << 24
_MOD = (1 << 61) - 1
_U64 = 1 << 64
_POSITIONS: dict[torch.device, torch.Tensor] = {}


class WeightSyncError(RuntimeError):
    """A bucket arrived damaged, stale or incomplete."""


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """``1..n`` as int64 on ``device``, cached (grown as needed, at most one chunk long)."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(1, n + 1, device=device, dtype=torch.int64)
        _POSITIONS[device] = cached
    return cached[:n]


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(torch.int32)


def _sums(t: torch.Tensor) -> torch.Tensor:
    """(2,) int64 on the tensor's device: the sum of its int32 words and the sum of word * position (1-based),
    both modulo 2**64 (int64 arithmetic wraps), computed in chunks without a host sync."""
    words = _words(t)
    total = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        plain = chunk.sum(dtype=torch.int64)
        weighted = torch.mul(chunk, _positions(chunk.numel(), chunk.device)).sum()
        total += torch.stack([plain, weighted + start * plain])
    return total


def _combine(plain: int, weighted: int) -> int:
    return ((plain % _U64) * 1_000_003 + weighted % _U64) % _MOD


def tensor_checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Checksums of the tensors' raw bytes (dtype and shape are checked separately), with one host sync for the
    whole list: the words' sum and position-weighted sum are reduced on each tensor's device, then combined."""
    if not tensors:
        return []
    sums = torch.stack([_sums(t).to(tensors[0].device) for t in tensors])
    return [_combine(a, b) for a, b in sums.tolist()]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queued work (pinned, non-blocking)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _word_end(offset: int, nbytes: int) -> int:
    return (offset + nbytes + 3) // 4


def bucket_checksums(
    buffer: torch.Tensor, spans: list[tuple[int, int]], chunk_words: int = _SCAN_WORDS
) -> list[int]:
    """The :func:`tensor_checksum` of each ``(offset, nbytes)`` span of the flat uint8 ``buffer``, in one pass
    over the buffer with one host sync. Offsets must be multiples of 4 and the bytes from a span's end to the next
    multiple of 4 zero (the sender writes them so): then a span's words are the zero-padded words the per-tensor
    checksum reads. With ``S1(x)``, ``S2(x)`` the sums of the first ``x`` words ``w_j`` and of ``w_j * (j + 1)``,
    a span of words ``[a, b)`` has plain sum ``S1(b) - S1(a)`` and position-weighted sum
    ``S2(b) - S2(a) - a * plain`` (all modulo 2**64, as int64 arithmetic wraps); the running sums are computed
    ``chunk_words`` words at a time (bounding the int64 temporaries) and read only at the spans' ends."""
    if not spans:
        return []
    if any(off % 4 for off, _ in spans):
        raise ValueError(
            f"bucket_checksums needs 4-byte aligned offsets, got {[o for o, _ in spans if o % 4]}"
        )
    starts = [off // 4 for off, _ in spans]
    ends = [_word_end(off, n) for off, n in spans]
    total = max(ends)
    if total * 4 > buffer.numel():
        raise WeightSyncError(
            f"bucket of {buffer.numel()} bytes is shorter than its tensors' {total * 4} bytes (partial transfer)"
        )
    words = buffer[: total * 4].view(torch.int32)
    points = sorted({p for p in starts + ends if p > 0})
    where = {p: i + 1 for i, p in enumerate(points)}  # row 0 of the table: the sums before word 0
    chunks = [(begin, min(begin + chunk_words, total)) for begin in range(0, total, chunk_words)]
    # per chunk: the positions (in the chunk) of the span ends it holds, then its own last position
    inside = [
        [p - 1 - begin for p in points if begin < p <= stop] + [stop - 1 - begin] for begin, stop in chunks
    ]
    host = (
        [i for rows in inside for i in rows]
        + [where.get(a, 0) for a in starts]
        + [where.get(b, 0) for b in ends]
    )
    index = _to_device(torch.tensor(host + starts, dtype=torch.int64), buffer.device)
    carry = torch.zeros(1, 2, dtype=torch.int64, device=buffer.device)
    rows, used = [carry], 0
    for (begin, stop), picks in zip(chunks, inside):
        chunk = words[begin:stop].to(torch.int64)
        plain = torch.cumsum(chunk, 0)
        weighted = torch.cumsum(chunk.mul_(_positions(stop - begin, chunk.device)), 0)
        del chunk
        at = index[used : used + len(picks)]
        p, w = plain[at], weighted[at]
        sums = torch.stack([p, w + begin * p], 1) + carry  # the running sums at the picks and the chunk's end
        rows.append(sums[:-1])
        carry, used = sums[-1:], used + len(picks)
    table, n = torch.cat(rows), len(spans)
    first, last = table[index[used : used + n]], table[index[used + n : used + 2 * n]]
    plain, weighted = (last - first).unbind(1)
    weighted = weighted - index[used + 2 * n :] * plain
    return [_combine(a, b) for a, b in torch.stack([plain, weighted], 1).tolist()]


def tensor_checksum(t: torch.Tensor) -> int:
    """Checksum of one tensor's raw bytes: a position-weighted sum of its bytes read as int32 words."""
    return tensor_checksums([t])[0]


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


def _pack(buffer: torch.Tensor, offset: int, tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Copy ``tensor`` into ``buffer`` at ``offset`` as ``dtype`` (cast and copy in one kernel, from any device, no
    host sync into a CUDA buffer) and zero the bytes up to the next 4-byte boundary; returns the bytes written."""
    nbytes = tensor.numel() * dtype.itemsize
    target = buffer[offset : offset + nbytes].view(dtype).view(tensor.shape)
    target.copy_(tensor, non_blocking=buffer.is_cuda)
    if nbytes % 4:
        buffer[offset + nbytes : _word_end(offset, nbytes) * 4].zero_()
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
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size {bucket_bytes} bytes must be positive")
        if buffer is not None and (
            buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < bucket_bytes
        ):
            raise ValueError(
                f"bucket buffer must be a 1-D uint8 tensor of at least {bucket_bytes} bytes, got "
                f"{buffer.dtype} of shape {tuple(buffer.shape)}"
            )
        self.transport, self.bucket_bytes, self.dtype = transport, bucket_bytes, dtype
        # A transport may own the buffer (shared memory, CUDA IPC) so the receiver reads it where it lies.
        self.buffer = (
            buffer if buffer is not None else torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        )

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Send every tensor; the last bucket is flagged ``is_last``. Returns counts and timings. Tensors are
        copied into the bucket as they come; a bucket's checksums are computed from the bucket itself when it
        goes out, with one host sync per bucket."""
        start = time.perf_counter()
        report = SyncReport()
        pending: list[tuple[str, tuple[int, ...], torch.dtype, int, int]] = []
        offset = 0
        for name, tensor in weights:
            dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * dtype.itemsize
            if nbytes > self.bucket_bytes:
                raise ValueError(
                    f"tensor {name!r} has {nbytes / 2**20:.1f} MiB, more than the weight-sync bucket "
                    f"({self.bucket_bytes / 2**20:.1f} MiB): raise "
                    f"rollout.update_weights_bucket_megabytes to at least {nbytes // 2**20 + 1}"
                )
            if offset + nbytes > self.bucket_bytes:
                self._flush(pending, report, is_last=False)
                pending, offset = [], 0
            _pack(self.buffer, offset, tensor, dtype)
            pending.append((name, tuple(tensor.shape), dtype, offset, nbytes))
            offset += (nbytes + 255) // 256 * 256
            report.num_tensors += 1
            report.num_bytes += nbytes
        self._flush(pending, report, is_last=True)
        report.seconds = time.perf_counter() - start
        return report

    def _flush(self, pending: list[tuple], report: SyncReport, is_last: bool) -> None:
        sums = bucket_checksums(self.buffer, [(off, nbytes) for _, _, _, off, nbytes in pending])
        metas = [TensorMeta(*entry, checksum) for entry, checksum in zip(pending, sums)]
        self.transport.send(Bucket(self.buffer, metas, report.num_buckets, is_last))
        report.num_buckets += 1


def unpack_bucket(
    bucket: Bucket, verify: bool = True, clone: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Views (or clones) of the tensors in ``bucket``; with ``verify`` every checksum is checked (one host sync
    for the bucket) before the first tensor is handed out."""
    views = []
    for meta in bucket.metas:
        end = meta.offset + meta.nbytes
        if end > bucket.buffer.numel():
            raise WeightSyncError(
                f"bucket {bucket.index}: tensor {meta.name!r} ends at byte {end}, past the "
                f"buffer's {bucket.buffer.numel()} bytes (partial transfer)"
            )
        views.append(bucket.buffer[meta.offset : end])
    if verify:
        sums = bucket_checksums(bucket.buffer, [(m.offset, m.nbytes) for m in bucket.metas])
        for meta, got in zip(bucket.metas, sums):
            if got != meta.checksum:
                raise WeightSyncError(
                    f"bucket {bucket.index}: checksum mismatch for {meta.name!r} (sent "
                    f"{meta.checksum}, received {got}); the rollout's weights are not updated"
                )
    for meta, raw in zip(bucket.metas, views):
        tensor = raw.view(meta.dtype).view(meta.shape)
        yield meta.name, tensor.clone() if clone else tensor


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
