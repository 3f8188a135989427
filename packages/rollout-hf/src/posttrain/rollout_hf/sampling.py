"""Token selection for the HF rollout: logits processing, sampling and the log-probs it reports.

Processing follows the order of HF's logits warpers and vLLM's sampler: divide the logits by the temperature,
keep the ``top_k`` largest, then keep the smallest set of tokens whose probability mass (renormalised over
what top-k left) reaches ``top_p``; removed tokens get ``-inf``. A token is drawn from the softmax ``p`` of
the processed logits with a ``torch.Generator`` as ``argmax(p / q)``, ``q ~ Exp(1)``: the draw
``torch.multinomial`` makes for one sample (the same generator use, so the same tokens), without its two host
syncs that check ``p``.

The log-prob reported for a sampled token is ``log_softmax(processed logits)[token]`` in float32: its
log-probability under the distribution it was actually drawn from (vLLM's
``logprobs_mode=processed_logprobs``).
With top-k and top-p off this is ``log_softmax(logits / temperature)``, the quantity an engine computes from
``fields["temperature"]``. Greedy decoding (temperature 0) takes the argmax and reports
``log_softmax(logits)[token]``, the log-prob at temperature 1 with no filtering.
"""

from __future__ import annotations

import torch

from posttrain.core import SamplingConfig


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(N, V) float32 logits after temperature, top-k and top-p; filtered entries are ``-inf``."""
    logits = logits.float()
    if sampling.temperature == 0:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= sampling.top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def select_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of (N, V) logits; returns (tokens (N,), log-probs (N,) float32)."""
    processed = process_logits(logits, sampling)
    log_probs = torch.log_softmax(processed, dim=-1)
    if sampling.temperature == 0:
        tokens = torch.argmax(processed, dim=-1)
    else:
        probs = log_probs.exp()
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        tokens = torch.argmax(probs / noise, dim=-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
