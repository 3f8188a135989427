"""The weight sync's previous checksum, kept as the same-run baseline of ``bench/vllm_sync.py``: the bucket's
bytes read as int32 words, widened to int64, and two running sums (``cumsum``) over every word, read at the
tensors' ends (code of ``0cff9d8``, ``posttrain.core.weight_sync.bucket_checksums``). The product replaced it
with :mod:`posttrain.core.checksum` (256-byte row hashes from one int8 matrix multiply)."""

from __future__ import annotations

import torch

from posttrain.core.checksum import WeightSyncError, _combine, _to_device

_SCAN_WORDS = 1 << 24
_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """``1..n`` as int64 on ``device``, cached (grown as needed, at most one chunk long)."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(1, n + 1, device=device, dtype=torch.int64)
        _POSITIONS[device] = cached
    return cached[:n]


def _word_end(offset: int, nbytes: int) -> int:
    return (offset + nbytes + 3) // 4


def word_bucket_checksums(
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
