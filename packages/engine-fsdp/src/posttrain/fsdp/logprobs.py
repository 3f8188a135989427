"""Next-token log-probs and entropy on the packed stream, without a full-vocabulary fp32 logits tensor.

The causal LM's ``lm_head`` is replaced by :class:`PackedLogProbHead`, which keeps the same weight (so the HF
parameter name and any tying with the input embedding stay as they were) and, while a :class:`HeadRequest` is
set, returns per-token statistics instead of logits. Running inside the model's own forward means FSDP's root
hooks gather and reduce the head weight as usual.

For packed hidden states ``h`` (T, H), targets ``y[t] = input_ids[t+1]`` and inverse temperatures
``1/tau[t+1]`` the head computes, ``chunk_size`` tokens at a time::

    z = (h W^T + b) / tau            # fp32, one chunk only
    log_prob[t] = z[y[t]] - logsumexp(z)
    entropy[t]  = logsumexp(z) - sum(softmax(z) * z)
    correct[t]  = argmax(h W^T + b) == y[t]      # only with ``with_accuracy``: 1.0 or 0.0, no gradient

When gradients are on and the request asks for it (``engine.entropy_checkpointing``), each chunk's fp32 part
runs under activation checkpointing: autograd keeps only the chunk's logits in the compute dtype (bf16 on GPU)
and recomputes the softmax in backward, so the fp32 working set is one chunk. The chunk size is
``engine.entropy_from_logits_chunk_size``, or the whole micro-batch without ``entropy_from_logits_with_chunking``. :func:`align_to_tokens` then shifts the results onto the token they score (the core
convention), with 0 at each sequence's first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class HeadRequest:
    """What :class:`PackedLogProbHead` computes for one forward."""

    targets: torch.Tensor
    """(T,) int64: the token each position predicts (the next token of the packed stream)."""
    inv_temperature: torch.Tensor
    """(T,) float32: 1 / temperature of the distribution that produced each target."""
    with_entropy: bool
    """Also return the entropy of each predicted distribution."""
    chunk_size: int
    """Tokens per chunk of the vocabulary projection."""
    valid_index: torch.Tensor | None = None
    """For padded (B, S) inputs: flat indices of the real tokens, in packed order; None for packed inputs."""
    checkpoint: bool = True
    """With gradients on, recompute each chunk's fp32 part in backward instead of keeping it."""
    with_accuracy: bool = False
    """Also return whether each target is the argmax of its logits (1.0 / 0.0, last column)."""


def _chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    z = logits.float() * inv_temp.unsqueeze(-1)
    lse = torch.logsumexp(z, dim=-1)
    log_prob = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return log_prob, None
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return log_prob, entropy


def next_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    request: HeadRequest,
    fn: Any = _chunk_stats,
) -> torch.Tensor:
    """(T, H) hidden -> (T, 1 to 3) [log_prob, entropy?, correct?] of ``request.targets``, chunked over tokens.

    ``fn`` is the per-chunk function (:func:`_chunk_stats` or a compiled copy of it). ``correct`` is the argmax
    of the chunk's logits (the ones the log-probs come from) compared with the target, outside autograd."""
    outs = []
    for start in range(0, hidden.shape[0], request.chunk_size):
        end = start + request.chunk_size
        logits = F.linear(hidden[start:end], weight, bias)
        args = (logits, request.targets[start:end], request.inv_temperature[start:end], request.with_entropy)
        if request.checkpoint and torch.is_grad_enabled():
            log_prob, entropy = checkpoint(fn, *args, use_reentrant=False)
        else:
            log_prob, entropy = fn(*args)
        cols = [log_prob] if entropy is None else [log_prob, entropy]
        if request.with_accuracy:
            with torch.no_grad():
                cols.append(logits.argmax(-1).eq(request.targets[start:end]).to(log_prob.dtype))
        outs.append(torch.stack(cols, -1))
    return torch.cat(outs, dim=0)


class PackedLogProbHead(torch.nn.Module):
    """Drop-in for a causal LM's ``lm_head`` (same ``weight``/``bias``) that returns token statistics.

    With ``request`` unset it is a plain linear layer, so ``generate`` and HF tooling keep working."""

    def __init__(self, linear: torch.nn.Module, use_compile: bool = False) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = getattr(linear, "bias", None)
        self.use_compile = use_compile
        self.request: HeadRequest | None = None
        self._stats_fn: Any = None

    def _chunk_fn(self, device: torch.device) -> Any:
        """The per-chunk function; compiled on first use on CUDA when ``use_compile``."""
        if self._stats_fn is None:
            use = self.use_compile and device.type == "cuda"
            self._stats_fn = torch.compile(_chunk_stats, dynamic=True) if use else _chunk_stats
        return self._stats_fn

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.request.valid_index is not None:
            flat = flat.index_select(0, self.request.valid_index)
        return next_token_stats(flat, self.weight, self.bias, self.request, self._chunk_fn(flat.device))


def shifted_targets(input_ids: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, inverse temperatures) for predicting token t+1 at position t of the packed stream."""
    return torch.roll(input_ids, -1), torch.roll(temperature.float(), -1).reciprocal()


def align_to_tokens(per_position: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move statistics of 'the token after t' onto that token; each sequence's first token gets 0."""
    aligned = torch.roll(per_position, 1, dims=0)
    starts = cu_seqlens[:-1].to(device=aligned.device, dtype=torch.long)
    return aligned.index_fill(0, starts, 0.0)
