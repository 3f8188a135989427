"""Row-hash checksums and finiteness of many tensors of one device, with few device operations and host syncs.

:func:`posttrain.core.checksum.tensor_checksums` runs about twenty ATen operations per tensor (views, an int8
matrix multiply, casts, sums), and ``isfinite(t).all()`` two more; a model with AdamW state holds about a
thousand tensors, most of them small (biases, norms, Adam's step counts), whose cost on a GPU is those
launches, not their bytes. Here tensors under :data:`SMALL` bytes (16 MiB on a GPU, 64 KiB on a CPU) are
copied, per dtype, into flat byte buckets of at most :data:`BUCKET` bytes, each tensor at a multiple of
:data:`~posttrain.core.checksum.ROW` bytes with zeros up to the next one (one ``torch.cat`` per bucket). One
pass over a bucket gives every tensor in it its checksum (:func:`~posttrain.core.checksum.bucket_checksums`: a
tensor's rows in the bucket are its zero-padded rows, so the checksum equals
:func:`~posttrain.core.checksum.tensor_checksum`), and the bucket viewed as its dtype tells whether all of
them are finite (the zero padding is a finite 0). Only a bucket holding NaN or inf has its tensors checked one
by one, to name them. Larger tensors go through ``tensor_checksums`` and ``isfinite`` one by one.
"""

from __future__ import annotations

import torch

from posttrain.core.checksum import ROW, bucket_checksums, padded, tensor_checksums

SMALL = {"cuda": 16 << 20, "cpu": 64 << 10}
"""Per device type, tensors with fewer bytes than this are checksummed in buckets (other devices: the CPU's).
On a GPU a tensor's twenty-odd launches (~0.1 ms) outweigh hashing 16 MiB; on a CPU the hashing itself costs
about 7 ms per MiB, so only tiny tensors gain from the copy."""
BUCKET = 128 << 20
"""Bytes of one bucket at most (a temporary on the tensors' device)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(tensors: list[torch.Tensor], indices: list[int]) -> list[list[int]]:
    """``indices`` grouped by dtype, in order, into buckets of at most :data:`BUCKET` padded bytes."""
    out: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in indices:
        dtype, size = tensors[i].dtype, padded(_nbytes(tensors[i]))
        members, used = open_.get(dtype, ([], 0))
        if members and used + size > BUCKET:
            out.append(members)
            members, used = [], 0
        open_[dtype] = (members + [i], used + size)
    return out + [members for members, _ in open_.values()]


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The tensors' bytes in one flat uint8 tensor, each at a multiple of ``ROW`` and zero-padded; the
    spans."""
    zeros = torch.zeros(ROW, dtype=torch.uint8, device=tensors[0].device)
    pieces, spans, offset = [], [], 0
    for t in tensors:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        pad = padded(flat.numel()) - flat.numel()
        pieces += [flat, zeros[:pad]] if pad else [flat]
        spans.append((offset, flat.numel()))
        offset += flat.numel() + pad
    return torch.cat(pieces), spans


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(t).all()


def checksums_and_finite(tensors: list[torch.Tensor]) -> tuple[list[int], list[bool]]:
    """The row-hash checksum of each tensor's bytes and whether it is finite (non-floating tensors count as
    finite); the tensors share one device and none is empty."""
    sums: list[int] = [0] * len(tensors)
    limit = SMALL.get(tensors[0].device.type, SMALL["cpu"]) if tensors else 0
    small = [i for i, t in enumerate(tensors) if _nbytes(t) < limit]
    large = [i for i, t in enumerate(tensors) if _nbytes(t) >= limit]
    for i, s in zip(large, tensor_checksums([tensors[i] for i in large])):
        sums[i] = s
    flags = [_all_finite(tensors[i]) for i in large]
    buckets = _buckets(tensors, small)
    for members in buckets:
        buffer, spans = _pack([tensors[i] for i in members])
        for i, s in zip(members, bucket_checksums(buffer, spans)):
            sums[i] = s
        flags.append(_all_finite(buffer.view(tensors[members[0]].dtype)))
    finite = [True] * len(tensors)
    found = torch.stack(flags).cpu().tolist() if flags else []
    for i, ok in zip(large, found):
        finite[i] = ok
    for members, ok in zip(buckets, found[len(large) :]):
        if not ok:  # name the non-finite tensors of this bucket
            for i in members:
                finite[i] = bool(_all_finite(tensors[i]))
    return sums, finite
