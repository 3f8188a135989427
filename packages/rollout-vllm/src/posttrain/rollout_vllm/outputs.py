"""vLLM's request outputs -> posttrain's :class:`~posttrain.core.rollout.RolloutSample`: token ids, the
sampled tokens' log-probs and, for MoE models, the experts each token was routed to."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.rollout import RolloutSample


def align_routing(routed: Any, length: int) -> torch.Tensor:
    """vLLM's (tokens fed, layers, k) expert ids -> (prompt + response, layers, k) int32 aligned with the
    tokens; the rows of tokens never fed to the model (the last sampled one) are -1."""
    routed = torch.as_tensor(routed, dtype=torch.int32)
    out = torch.full((length, *routed.shape[1:]), -1, dtype=torch.int32)
    fed = min(routed.shape[0], length - 1)
    out[:fed] = routed[:fed]
    return out


def samples_of(index: int, out: Any) -> list[RolloutSample]:
    """A :class:`RolloutSample` per sample of one vLLM ``RequestOutput`` (prompt ``index``), in sample
    order."""
    samples = []
    prompt = list(out.prompt_token_ids)
    for comp in sorted(out.outputs, key=lambda c: c.index):
        ids = list(comp.token_ids)
        lps = torch.tensor(_sampled_logprobs(comp.logprobs, ids), dtype=torch.float32)
        routed = getattr(comp, "routed_experts", None)
        samples.append(
            RolloutSample(
                prompt_index=index,
                prompt_ids=prompt,
                response_ids=ids,
                log_probs=lps,
                finish_reason=str(comp.finish_reason or "length"),
                routed_experts=None if routed is None else align_routing(routed, len(prompt) + len(ids)),
            )
        )
    return samples


def _sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-sample record: with ``flat_logprobs`` and ``logprobs=0``
    each position holds exactly the sampled token, so the flat list is the answer; otherwise (a dict per
    position) each position's entry for its token."""
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list) and len(flat) == len(ids) and list(logprobs.token_ids) == ids:
        return flat
    return [logprobs[i][t].logprob for i, t in enumerate(ids)]
