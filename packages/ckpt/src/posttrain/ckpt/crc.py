"""CRC-32 of byte spans of many files, on a pool of threads, in pieces of at most :data:`PIECE` bytes.

Each span (a stored item of a DCP shard, a gap between items, a whole small file) is cut into pieces; the
pieces of every file given run on one thread pool (``zlib.crc32`` releases the GIL), in the order given, so
that one large tensor's span does not keep one thread busy while the others idle, and a cold file is read by
several threads at once. With ``read_ahead`` each piece asks the kernel for its pages before hashing them
(``POSIX_FADV_WILLNEED``: large asynchronous reads instead of a page fault at a time; a no-op for pages
already cached). A span's CRC is its pieces' CRCs combined (:func:`crc32_combine`, zlib's ``crc32_combine``),
equal to ``zlib.crc32`` of the span's bytes.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PIECE = 16 << 20
"""Bytes hashed per job of the pool."""
MAX_THREADS = 16
_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected
_OPEN_FILES = 64  # files mapped at a time


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, both bit-reflected (``a`` non-zero), as zlib's ``multmodp``."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()
"""``x^(2^k)`` modulo the polynomial, ``k = 0..31``."""


@functools.lru_cache(maxsize=256)
def _x8n(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: ``n`` zero bytes' worth of shift."""
    p, k = 1 << 31, 3  # x^0; 8n = n << 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    return _multmodp(_x8n(len2), crc1) ^ crc2


def threads() -> int:
    """Threads of the CRC pool: the cores this process may run on, at most :data:`MAX_THREADS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def _pieces(spans: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(span index, offset, length) of each piece of each span, in order; an empty span has one empty
    piece."""
    out = []
    for i, (offset, length) in enumerate(spans):
        out += [(i, o, min(PIECE, offset + length - o)) for o in range(offset, offset + length, PIECE)]
        if not length:
            out.append((i, offset, 0))
    return out


def span_crcs(files: list[tuple[Path, list[tuple[int, int]]]], read_ahead: bool = True) -> list[list[int]]:
    """``zlib.crc32`` of each ``(offset, length)`` span of each ``(path, spans)``, every span inside its file,
    read file by file and span by span; ``read_ahead``: ask for each piece's pages first (see the module
    docstring)."""
    out: list[list[int]] = []
    with ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="posttrain-ckpt-crc") as pool:
        for start in range(0, len(files), _OPEN_FILES):
            out += _span_crcs(files[start : start + _OPEN_FILES], pool, read_ahead)
    return out


def _span_crcs(
    files: list[tuple[Path, list[tuple[int, int]]]], pool: ThreadPoolExecutor, read_ahead: bool
) -> list[list[int]]:
    with contextlib.ExitStack() as stack:
        fds, views = [], []
        for path, _ in files:
            fds.append(os.open(path, os.O_RDONLY))
            stack.callback(os.close, fds[-1])
            view = memoryview(b"")
            if os.fstat(fds[-1]).st_size:
                mapped = mmap.mmap(fds[-1], 0, access=mmap.ACCESS_READ)
                stack.callback(mapped.close)
                view = memoryview(mapped)
                stack.callback(view.release)
            views.append(view)

        def crc(job: tuple[int, int, int, int]) -> int:
            f, _, offset, length = job
            if read_ahead and length > mmap.PAGESIZE and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fds[f], offset, length, os.POSIX_FADV_WILLNEED)
            return zlib.crc32(views[f][offset : offset + length])

        jobs = [(f, *piece) for f, (_, spans) in enumerate(files) for piece in _pieces(spans)]
        out: list[list[int]] = [[0] * len(spans) for _, spans in files]
        for (f, span, offset, length), value in zip(jobs, pool.map(crc, jobs)):
            first = offset == files[f][1][span][0]
            out[f][span] = value if first else crc32_combine(out[f][span], value, length)
        return out
