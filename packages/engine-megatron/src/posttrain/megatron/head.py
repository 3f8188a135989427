"""Log-probs and entropy of vocab-parallel (TP-sharded) logits, in row chunks, with a hand-written backward.

Each TP rank holds ``V / tp`` columns of the logits ``l`` (rows: tokens). With ``x = l / tau`` (the row's
sampling temperature), ``m`` the row's global max (an all-reduce), ``s = x - m`` and ``Z = sum_v exp(s_v)``
(an all-reduce)::

    log p(y) = s_y - log Z                  (s_y contributed by the rank that owns column y)
    H        = log Z - sum_v p_v s_v        (p = exp(s - log Z))

Backward needs no collective: with ``E = sum_v p_v s_v = log Z - H`` (saved per row),
``d log p(y) / d s_v = [v = y] - p_v`` and ``dH / d s_v = -p_v (s_v - E)``, and each rank fills the gradient
of its own columns; ``d / d l = (d / d s) / tau``. Forward and backward both walk ``chunk_size`` rows at a
time in float32, so the fp32 working set is one chunk; autograd keeps the logits in their own dtype (bf16 on
GPU) and three floats per row, and backward recomputes ``p`` once per chunk. This is cheaper than autograd
through the same formulas (which saves several fp32 ``(T, V/tp)`` tensors) and than activation checkpointing
of each chunk (which runs the forward twice): measured on the GPU machine, BENCHMARKS.md.

The per-chunk math between the collectives is four pure functions (:class:`ChunkFns`). Eager, each chunk
costs about ten fp32 passes over ``(rows, V/tp)`` forward and as many backward; ``use_compile`` runs them
through ``torch.compile``, which fuses each into one read of the logits (and, backward, one write of their
gradient) in their own dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _scaled(logits: torch.Tensor, temp: torch.Tensor | None) -> torch.Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
    return x if temp is None else x / temp[:, None]


def _owned(targets: torch.Tensor, vocab_start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this shard, clamped; whether this shard owns it)."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), owned


def _row_max(logits: torch.Tensor, temp: torch.Tensor | None) -> torch.Tensor:
    return _scaled(logits, temp).max(dim=-1).values


def _sum_exp(logits: torch.Tensor, temp: torch.Tensor | None, row_max: torch.Tensor) -> torch.Tensor:
    return (_scaled(logits, temp) - row_max[:, None]).exp().sum(dim=-1)


def _p_dot_s(
    logits: torch.Tensor, temp: torch.Tensor | None, row_max: torch.Tensor, log_z: torch.Tensor
) -> torch.Tensor:
    """sum_v p_v s_v over this shard's columns."""
    s = _scaled(logits, temp) - row_max[:, None]
    return (torch.exp(s - log_z[:, None]) * s).sum(dim=-1)


def _grad(
    logits: torch.Tensor,
    temp: torch.Tensor | None,
    row_max: torch.Tensor,
    log_z: torch.Tensor,
    mean_s: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    col: torch.Tensor,
    owned: torch.Tensor,
) -> torch.Tensor:
    """d loss / d logits of one chunk, in the logits' dtype; ``mean_s`` is E = log Z - H (with ``g_ent``)."""
    s = _scaled(logits, temp) - row_max[:, None]
    p = torch.exp(s - log_z[:, None])
    g = torch.zeros_like(s)
    if g_ent is not None and mean_s is not None:  # dH/ds = -p (s - E)
        g = g - g_ent[:, None] * p * (s - mean_s[:, None])
    if g_lp is not None:  # d log p(y)/ds = onehot(y) - p
        hit = (torch.arange(s.size(-1), device=s.device)[None, :] == col[:, None]) & owned[:, None]
        g = g - g_lp[:, None] * p + torch.where(hit, g_lp[:, None], 0.0)
    return (g if temp is None else g / temp[:, None]).to(logits.dtype)


@dataclass(frozen=True)
class ChunkFns:
    """The per-chunk math of the head, eager or compiled."""

    row_max: Callable[..., torch.Tensor]
    sum_exp: Callable[..., torch.Tensor]
    p_dot_s: Callable[..., torch.Tensor]
    grad: Callable[..., torch.Tensor]


EAGER = ChunkFns(_row_max, _sum_exp, _p_dot_s, _grad)


@functools.cache
def compiled_chunk_fns() -> ChunkFns:
    """:data:`EAGER`, each function through ``torch.compile`` (dynamic shapes: one compile serves every
    chunk length); compiled on first call, once per process."""
    return ChunkFns(*(torch.compile(f, dynamic=True) for f in astuple(EAGER)))


def _chunk_forward(
    fns: ChunkFns,
    logits: torch.Tensor,
    temp: torch.Tensor | None,
    targets: torch.Tensor,
    vocab_start: int,
    group: Any,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(targets), row max, log Z, entropy or None) of one chunk of logits."""
    row_max = _all_reduce(fns.row_max(logits, temp), dist.ReduceOp.MAX, group)
    log_z = torch.log(_all_reduce(fns.sum_exp(logits, temp, row_max), dist.ReduceOp.SUM, group))
    col, owned = _owned(targets, vocab_start, logits.size(-1))
    x_y = _scaled(logits.gather(-1, col[:, None]), temp).squeeze(-1)
    picked = _all_reduce((x_y - row_max) * owned, dist.ReduceOp.SUM, group)
    entropy = None
    if with_entropy:
        entropy = log_z - _all_reduce(fns.p_dot_s(logits, temp, row_max, log_z), dist.ReduceOp.SUM, group)
    return picked - log_z, row_max, log_z, entropy


class _VocabParallelHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temp, vocab_start, group, with_entropy, chunk_size, fns):
        # fns: the ChunkFns, eager or compiled
        lps, maxes, log_zs, ents = [], [], [], []
        for start in range(0, logits.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            tau = None if temp is None else temp[rows]
            lp, row_max, log_z, ent = _chunk_forward(
                fns, logits[rows], tau, targets[rows], vocab_start, group, with_entropy
            )
            lps.append(lp)
            maxes.append(row_max)
            log_zs.append(log_z)
            ents.append(ent if with_entropy else lp.new_zeros(0))
        empty = logits.new_zeros(0, dtype=torch.promote_types(logits.dtype, torch.float32))
        lp, ent = (torch.cat(lps), torch.cat(ents)) if lps else (empty, empty)
        row_max, log_z = (torch.cat(maxes), torch.cat(log_zs)) if lps else (empty, empty)
        ctx.save_for_backward(logits, targets, temp, row_max, log_z, ent)
        ctx.vocab_start, ctx.with_entropy, ctx.chunk_size, ctx.fns = (
            vocab_start,
            with_entropy,
            chunk_size,
            fns,
        )
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):  # noqa: ANN001
        logits, targets, temp, row_max, log_z, ent = ctx.saved_tensors
        if g_ent is not None and not ctx.with_entropy:
            g_ent = None
        if g_lp is None and g_ent is None:
            return torch.zeros_like(logits), None, None, None, None, None, None, None
        grad = torch.empty_like(logits)
        for start in range(0, logits.size(0), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            col, owned = _owned(targets[rows], ctx.vocab_start, logits.size(-1))
            grad[rows] = ctx.fns.grad(
                logits[rows],
                None if temp is None else temp[rows],
                row_max[rows],
                log_z[rows],
                None if g_ent is None else log_z[rows] - ent[rows],
                None if g_lp is None else g_lp[rows],
                None if g_ent is None else g_ent[rows],
                col,
                owned,
            )
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    tp_group: Any,
    with_entropy: bool,
    temperature: torch.Tensor | None = None,
    chunk_size: int = 2048,
    use_compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) in float32 (float64 for float64 logits) per row of this rank's
    ``(N, V/tp)`` logits, whose first column is vocabulary id ``vocab_start``; rows divided by ``temperature``
    (N,) first. Collective over ``tp_group`` (None or one rank: no communication); every rank of it passes the
    same rows. ``use_compile``: the per-chunk math through ``torch.compile`` (:func:`compiled_chunk_fns`)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (engine.entropy_from_logits_chunk_size)")
    temp = None if temperature is None else temperature.to(logits.device, torch.float32)
    fns = compiled_chunk_fns() if use_compile else EAGER
    lp, ent = _VocabParallelHead.apply(
        logits, targets.to(logits.device), temp, vocab_start, tp_group, with_entropy, chunk_size, fns
    )
    return lp, ent if with_entropy else None


@torch.no_grad()
def vocab_parallel_argmax_hits(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp_group: Any, chunk_size: int = 2048
) -> torch.Tensor:
    """1.0 where ``targets`` is the argmax (the first index of the maximum, as ``torch.argmax``) of its row of
    the vocab-parallel ``(N, V/tp)`` logits, else 0.0, in float32; ``chunk_size`` rows at a time in the
    logits' own dtype (a temperature would not move the argmax). Collective over ``tp_group`` like
    :func:`vocab_parallel_logprobs`: two all-reduces of one value per row."""
    hits = []
    targets = targets.to(logits.device)
    for start in range(0, logits.size(0), chunk_size):
        values, index = logits[start : start + chunk_size].max(dim=-1)
        best = _all_reduce(values.clone(), dist.ReduceOp.MAX, group=tp_group)
        first = torch.where(values == best, index + vocab_start, torch.iinfo(torch.long).max)
        first = _all_reduce(first, dist.ReduceOp.MIN, group=tp_group)
        hits.append(first.eq(targets[start : start + chunk_size]).float())
    return torch.cat(hits) if hits else logits.new_zeros(0, dtype=torch.float32)
