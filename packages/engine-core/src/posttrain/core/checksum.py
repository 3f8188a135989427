"""Checksums of the weight sync's tensors, computed on the tensors' device with one read of their bytes.

A tensor's bytes, zero-padded to a multiple of :data:`ROW` (256) bytes, are cut into rows of 256 signed bytes.
Row ``r`` hashes to ``u_r = sum_c C_c * (row_r @ W)[c]``: ``W`` is a fixed (256, 8) matrix of odd int8 values
and ``C`` eight fixed odd 62-bit constants, both drawn from a 64-bit LCG so that every host and torch version
has the same ones. The row product is one int8 matrix multiply (``torch._int_mm``, exact in int32: at most
256 * 128 * 128 in magnitude), so the bytes are read once and no wide temporary of the tensor's size exists.
The checksum is the pair (``sum_r u_r``, ``sum_r (r + 1) * u_r``) modulo 2**64 (int64 arithmetic wraps),
folded into one integer. A byte changed by ``d`` (``0 < |d| < 256``) changes its row's hash by
``d * k`` with ``k = sum_c C_c * W[byte, c]``; every byte position's ``k`` is non-zero modulo 2**56 (a test
checks all 256), so a single changed byte always changes the checksum. A moved row changes the
position-weighted sum; a truncated tensor loses rows. It is a check against transport faults (a stale,
partial, misplaced or corrupted bucket), not against an adversary.

:func:`bucket_checksums` gives every tensor of a bucket its checksum from one pass over the bucket: tensors
start at multiples of 256 bytes and the sender zeroes the bytes from each tensor's end to the next multiple
of 256, so a tensor's rows inside the bucket are exactly its zero-padded rows. The row hashes' running sums
are read at the tensors' first and last rows (:func:`span_sums`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW = 256
"""Bytes per checksum row; tensors sit in a bucket at multiples of it."""
_COLS = 8
_CHUNK_ROWS = 1 << 21  # 512 MiB of bytes per matrix multiply; bounds the int64 temporaries at 128 MiB
_MIN_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows
_MOD = (1 << 61) - 1
_U64 = 1 << 64
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_POSITIONS: dict[torch.device, torch.Tensor] = {}
_SPAN_PLANS: dict[tuple, tuple[list[tuple[int, int]], list[int], torch.Tensor]] = {}
"""(span starts, ends, chunk, device) -> what :func:`span_sums` reads where, cached: a weight sync checksums
the same bucket layouts every step, and building the index costs about a millisecond a bucket of 338
tensors."""
_MAX_SPAN_PLANS = 64


class WeightSyncError(RuntimeError):
    """A bucket arrived damaged, stale or incomplete."""


def _lcg(n: int, seed: int) -> list[int]:
    out, state = [], seed
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % _U64
        out.append(state)
    return out


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(W: int8 (256, 8), odd values in [-127, 127]; C: int64 (8,), odd) on ``device``, cached. ``W`` is
    column-major (the transpose of a contiguous (8, 256)): the operand layout cuBLASLt's int8 GEMM takes."""
    if device not in _TABLES:
        w = [((x >> 57) * 2 + 1) - 128 for x in _lcg(ROW * _COLS, 1)]
        c = [(x >> 2) | 1 for x in _lcg(_COLS, 2)]
        _TABLES[device] = (
            torch.tensor(w, dtype=torch.int8).view(ROW, _COLS).t().contiguous().to(device).t(),
            torch.tensor(c, dtype=torch.int64).to(device),
        )
    return _TABLES[device]


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """``1..n`` as int64 on ``device``, cached (grown as needed, at most one chunk long)."""
    cached = _POSITIONS.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(1, n + 1, device=device, dtype=torch.int64)
        _POSITIONS[device] = cached
    return cached[:n]


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole rows."""
    return (nbytes + ROW - 1) // ROW * ROW


def row_hashes(rows: torch.Tensor) -> torch.Tensor:
    """int64 hash of each row of a (n, 256) int8 tensor (see the module docstring)."""
    w, c = _tables(rows.device)
    if rows.device.type == "cpu":
        # the same products in float32, exact (every sum is below 256 * 128 * 127 < 2**24): about twice as
        # fast as torch._int_mm on a CPU
        return (torch.mm(rows.to(torch.float32), w.to(torch.float32)).to(torch.int64) * c).sum(1)
    n = rows.shape[0]
    if n < _MIN_ROWS:  # zero rows hash to zero
        rows = torch.cat([rows, rows.new_zeros(_MIN_ROWS - n, ROW)])
    return (torch._int_mm(rows, w)[:n].to(torch.int64) * c).sum(1)


def _combine(plain: int, weighted: int) -> int:
    return ((plain % _U64) * 1_000_003 + weighted % _U64) % _MOD


def _rows(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = padded(flat.numel()) - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(torch.int8).view(-1, ROW)


def tensor_checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Checksums of the tensors' raw bytes (dtype and shape are checked separately), with one host sync for
    the whole list."""
    if not tensors:
        return []
    sums = []
    for t in tensors:
        rows = _rows(t)
        total = torch.zeros(2, dtype=torch.int64, device=rows.device)
        for begin in range(0, rows.shape[0], _CHUNK_ROWS):
            u = row_hashes(rows[begin : begin + _CHUNK_ROWS])
            plain = u.sum()
            weighted = (u * _positions(u.numel(), u.device)).sum() + begin * plain
            total += torch.stack([plain, weighted])
        sums.append(total.to(tensors[0].device))
    return [_combine(a, b) for a, b in torch.stack(sums).tolist()]


def tensor_checksum(t: torch.Tensor) -> int:
    """Checksum of one tensor's raw bytes."""
    return tensor_checksums([t])[0]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queued work (pinned,
    non-blocking)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _span_plan(
    starts: list[int], ends: list[int], chunk: int, device: torch.device
) -> tuple[list[tuple[int, int]], list[int], torch.Tensor]:
    """The chunks of the scan, how many picks each chunk has, and one int64 index on ``device``: per chunk the
    positions (in the chunk) of the span ends it holds then its own last position; the table rows of the
    spans' starts and of their ends; the starts themselves. Cached per layout (:data:`_SPAN_PLANS`)."""
    key = (tuple(starts), tuple(ends), chunk, device)
    plan = _SPAN_PLANS.get(key)
    if plan is None:
        total = max(ends)
        points = sorted({p for p in starts + ends if p > 0})
        where = {p: i + 1 for i, p in enumerate(points)}  # row 0 of the table: the sums before unit 0
        chunks = [(begin, min(begin + chunk, total)) for begin in range(0, total, chunk)]
        inside = [
            [p - 1 - begin for p in points if begin < p <= stop] + [stop - 1 - begin]
            for begin, stop in chunks
        ]
        host = (
            [i for picks in inside for i in picks]
            + [where.get(a, 0) for a in starts]
            + [where.get(b, 0) for b in ends]
        )
        index = _to_device(torch.tensor(host + starts, dtype=torch.int64), device)
        if len(_SPAN_PLANS) >= _MAX_SPAN_PLANS:
            _SPAN_PLANS.clear()
        plan = _SPAN_PLANS[key] = (chunks, [len(picks) for picks in inside], index)
    return plan


def span_sums(
    values: Callable[[int, int], torch.Tensor],
    starts: list[int],
    ends: list[int],
    chunk: int,
    device: torch.device,
) -> list[int]:
    """The combined (plain, position-weighted) sums of unit values over each unit span
    ``[starts[i], ends[i])``, in one pass with one host sync. ``values(begin, stop)`` returns the int64 values
    of units ``begin..stop-1`` as a fresh tensor (it is overwritten). With ``S1(x)``, ``S2(x)`` the sums of
    the first ``x`` values ``u_j`` and of ``u_j * (j + 1)``, a span ``[a, b)`` has plain sum ``S1(b) - S1(a)``
    and position-weighted sum ``S2(b) - S2(a) - a * plain`` (modulo 2**64); the running sums are computed
    ``chunk`` units at a time and read only at the spans' ends (:func:`_span_plan`)."""
    chunks, counts, index = _span_plan(starts, ends, chunk, device)
    carry = torch.zeros(1, 2, dtype=torch.int64, device=device)
    table, used = [carry], 0
    for (begin, stop), count in zip(chunks, counts):
        u = values(begin, stop)
        plain = torch.cumsum(u, 0)
        weighted = torch.cumsum(u.mul_(_positions(stop - begin, device)), 0)
        del u
        at = index[used : used + count]
        p, w = plain[at], weighted[at]
        sums = torch.stack([p, w + begin * p], 1) + carry  # the running sums at the picks and the chunk's end
        table.append(sums[:-1])
        carry, used = sums[-1:], used + count
    flat, n = torch.cat(table), len(starts)
    first, last = flat[index[used : used + n]], flat[index[used + n : used + 2 * n]]
    plain, weighted = (last - first).unbind(1)
    weighted = weighted - index[used + 2 * n :] * plain
    return [_combine(a, b) for a, b in torch.stack([plain, weighted], 1).tolist()]


def bucket_checksums(
    buffer: torch.Tensor, spans: list[tuple[int, int]], chunk_rows: int = _CHUNK_ROWS
) -> list[int]:
    """The :func:`tensor_checksum` of each ``(offset, nbytes)`` span of the flat uint8 ``buffer``, in one pass
    over the buffer with one host sync (:func:`span_sums` over the row hashes, ``chunk_rows`` rows at a time).
    Offsets must be multiples of :data:`ROW` and the bytes from a span's end to the next multiple zero (the
    sender writes them so): then a span's rows are the tensor's zero-padded rows."""
    if not spans:
        return []
    if any(off % ROW for off, _ in spans):
        raise ValueError(
            f"bucket_checksums needs offsets at multiples of {ROW} bytes, got "
            f"{[o for o, _ in spans if o % ROW]}"
        )
    starts = [off // ROW for off, _ in spans]
    ends = [padded(off + n) // ROW for off, n in spans]
    total = max(ends)
    if total * ROW > buffer.numel():
        raise WeightSyncError(
            f"bucket of {buffer.numel()} bytes is shorter than its tensors' {total * ROW} bytes (partial "
            "transfer)"
        )
    rows = buffer[: total * ROW].view(torch.int8).view(total, ROW)
    return span_sums(lambda b, e: row_hashes(rows[b:e]), starts, ends, chunk_rows, buffer.device)
