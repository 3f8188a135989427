"""Next-token log-probs, entropy and accuracy of a packed stream, chunk by chunk, never a full fp32 logits
tensor.

The FSDP and torchtitan engines replace the model's output layer with a head that keeps the layer's weight
and, while a :class:`HeadRequest` is set, returns per-position statistics instead of
logits: :func:`next_token_stats`.
For hidden states ``h`` (T, H), targets ``y[t] = input_ids[t+1]`` and inverse temperatures ``1/tau[t+1]``
(:func:`shifted_targets`) it computes, ``chunk_size`` positions at a time::

    z = (h W^T + b) / tau            # fp32, one chunk only
    log_prob[t] = z[y[t]] - logsumexp(z)
    entropy[t]  = logsumexp(z) - sum(softmax(z) * z)
    correct[t]  = argmax(h W^T + b) == y[t]      # only with ``with_accuracy``: 1.0 or 0.0, no gradient

With gradients on and ``checkpoint``, each chunk's per-chunk function runs under activation checkpointing, so
autograd keeps only the chunk's logits in the compute dtype and the fp32 working set is one chunk.
:func:`align_to_tokens` then moves each statistic onto the token it scores (0 at each sequence's first token,
the convention of :mod:`posttrain.core.batch`) and :func:`token_outputs` names the columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class HeadRequest:
    """What the output layer's head computes for one forward."""

    targets: torch.Tensor
    """(T,) int64: the token each position predicts (the next token of the packed stream)."""
    inv_temperature: torch.Tensor
    """(T,) float32: 1 / temperature of the distribution that produced each target."""
    with_entropy: bool
    """Also return the entropy of each predicted distribution."""
    chunk_size: int
    """Positions per chunk of the vocabulary projection."""
    valid_index: torch.Tensor | None = None
    """For padded (B, S) inputs: flat indices of the real tokens, in packed order; None for packed inputs."""
    checkpoint: bool = True
    """With gradients on, recompute each chunk's fp32 part in backward instead of keeping it."""
    with_accuracy: bool = False
    """Also return whether each target is the argmax of its logits (1.0 / 0.0, the last column)."""


Stats = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""(log_prob, entropy or None, correct or None) of one chunk."""

ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool], Stats]
"""(logits, targets, inverse temperatures, with_entropy, with_accuracy) -> :data:`Stats` of one chunk."""


def chunk_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: torch.Tensor,
    with_entropy: bool,
    with_accuracy: bool,
) -> Stats:
    """The statistics of one chunk of logits (rows: positions; columns: the whole vocabulary)."""
    z = logits.float() * inv_temp.unsqueeze(-1)
    lse = torch.logsumexp(z, dim=-1)
    log_prob = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    correct = logits.detach().argmax(-1).eq(targets).to(log_prob.dtype) if with_accuracy else None
    return log_prob, entropy, correct


def local_chunk_fn(device: torch.device, use_compile: bool) -> ChunkFn:
    """:func:`chunk_stats`, compiled (dynamic shapes) when ``use_compile`` and ``device`` is CUDA; a head
    calls it once and keeps the result, so it compiles on first use."""
    return torch.compile(chunk_stats, dynamic=True) if use_compile and device.type == "cuda" else chunk_stats


def next_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    request: HeadRequest,
    fn: ChunkFn = chunk_stats,
) -> torch.Tensor:
    """(T, H) hidden -> (T, 1 to 3) [log_prob, entropy?, correct?] of ``request.targets``, chunked over
    positions. ``fn`` is the per-chunk function: :func:`chunk_stats`, a compiled copy of it, or a
    vocabulary-parallel one."""
    outs = []
    for start in range(0, hidden.shape[0], request.chunk_size):
        end = start + request.chunk_size
        logits = F.linear(hidden[start:end], weight, bias)
        args = (logits, request.targets[start:end], request.inv_temperature[start:end])
        args += (request.with_entropy, request.with_accuracy)
        if request.checkpoint and torch.is_grad_enabled():
            stats = checkpoint(fn, *args, use_reentrant=False)
        else:
            stats = fn(*args)
        outs.append(torch.stack([s for s in stats if s is not None], -1))
    return torch.cat(outs, dim=0)


def shifted_targets(input_ids: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, inverse temperatures) for predicting token t+1 at position t of the packed stream."""
    return torch.roll(input_ids, -1), torch.roll(temperature.float(), -1).reciprocal()


def align_to_tokens(per_position: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move statistics of 'the token after t' onto that token; each sequence's first token gets 0."""
    aligned = torch.roll(per_position, 1, dims=0)
    starts = cu_seqlens[:-1].to(device=aligned.device, dtype=torch.long)
    return aligned.index_fill(0, starts, 0.0)


def token_outputs(
    stats: torch.Tensor, cu_seqlens: torch.Tensor, with_entropy: bool, with_accuracy: bool
) -> dict[str, torch.Tensor]:
    """The head's (T, 1 to 3) statistics per token: ``log_probs``, and ``entropy`` / ``correct`` when
    asked."""
    out = {"log_probs": align_to_tokens(stats[:, 0], cu_seqlens)}
    if with_entropy:
        out["entropy"] = align_to_tokens(stats[:, 1], cu_seqlens)
    if with_accuracy:
        out["correct"] = align_to_tokens(stats[:, -1], cu_seqlens)
    return out
