"""The causal LM's output layer as a head that returns next-token log-probs, never a full fp32 logits tensor.

The model's ``lm_head`` is replaced by :class:`PackedLogProbHead`, which keeps the same weight (so the HF
parameter name and any tying with the input embedding stay as they were) and, while a
:class:`~posttrain.core.token_stats.HeadRequest` is set, returns per-token statistics instead of logits
(log-prob, entropy, accuracy; computed chunk by chunk by :func:`posttrain.core.token_stats.next_token_stats`,
the torchtitan engine's head too). Running inside the model's own forward means FSDP's root hooks gather and
reduce the head weight as usual. The chunk size is ``engine.entropy_from_logits_chunk_size``, or the whole
micro-batch without ``entropy_from_logits_with_chunking``; with ``engine.entropy_checkpointing`` each chunk's
fp32 part is recomputed in backward. For padded (B, S) inputs the request's ``valid_index`` picks the real
tokens first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.core.token_stats import HeadRequest, local_chunk_fn, next_token_stats


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
            self._stats_fn = local_chunk_fn(device, self.use_compile)
        return self._stats_fn

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.request.valid_index is not None:
            flat = flat.index_select(0, self.request.valid_index)
        return next_token_stats(flat, self.weight, self.bias, self.request, self._chunk_fn(flat.device))
