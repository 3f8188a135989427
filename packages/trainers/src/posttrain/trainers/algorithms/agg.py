"""Loss aggregation (``loss_agg_mode``) on packed micro-batches, normalised by the global counts of the step.

For a per-token loss ``l`` (T,), mask ``m`` and the step's :class:`~posttrain.core.batch.LossContext`
(N = loss tokens and S = sequences over every micro-batch and data-parallel rank, D = data-parallel size):

- ``token-mean``: ``sum_t l_t m_t / N * D``
- ``seq-mean-token-sum``: ``sum_i (sum_{t in i} l_t m_t) / S * D``
- ``seq-mean-token-mean``: ``sum_i (sum_{t in i} l_t m_t / sum_{t in i} m_t) / S * D``
- ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor`` (Dr.GRPO's constant length norm)

Summing the per-micro-batch results and averaging over D ranks (what gradient accumulation and DP all-reduce
do) gives exactly the global mean, whatever the micro-batching. Departures from verl's ``agg_loss``: S counts
every sequence, also one with no loss tokens (verl's global path does the same, its local path does not);
``seq-mean-token-sum-norm`` needs an explicit ``loss_scale_factor`` because a packed batch has no padded
horizon (verl's default, ``loss_mask.shape[-1]``, depends on padding); the trainer passes
``rollout.response_length`` when ``actor.loss_scale_factor`` is unset.

:class:`LossTokens` bundles what aggregation needs of a micro-batch (mask, boundaries, the step's counts, the
scale factor); the policy and value losses take one instead of four arguments each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.core.batch import LossContext

from .names import check_loss_agg_mode
from .packed import masked_mean, segment_sum, seq_index_from_cu


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str,
    ctx: LossContext,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the global aggregate of ``loss`` (T,) (see the module docstring)."""
    check_loss_agg_mode(mode)
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / max(ctx.global_num_tokens, 1) * ctx.dp_size
    seq_index = seq_index_from_cu(cu_seqlens.to(loss.device))
    num_seqs = cu_seqlens.numel() - 1
    seq_sums = segment_sum(loss * mask, seq_index, num_seqs)
    if mode == "seq-mean-token-mean":
        seq_sums = seq_sums / segment_sum(mask, seq_index, num_seqs).clamp(min=1)
    out = seq_sums.sum() / max(ctx.global_num_seqs, 1) * ctx.dp_size
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or loss_scale_factor <= 0:
            raise ValueError(
                f"loss_agg_mode=seq-mean-token-sum-norm needs a positive loss_scale_factor, got "
                f"{loss_scale_factor}: set actor.loss_scale_factor (e.g. to rollout.response_length)"
            )
        out = out / loss_scale_factor
    return out


@dataclass(kw_only=True)
class LossTokens:
    """The loss tokens of one micro-batch and the step's global counts: what turns a per-token loss into this
    micro-batch's share of the global aggregate. T = tokens, B = sequences of the micro-batch."""

    mask: torch.Tensor
    """(T,) 1 on the tokens the loss counts."""
    cu_seqlens: torch.Tensor
    """(B+1,) sequence boundaries."""
    ctx: LossContext
    """Loss tokens and sequences of the whole step, over every micro-batch and data-parallel rank."""
    loss_scale_factor: float | None = None
    """Divisor of ``seq-mean-token-sum-norm``."""

    def agg(self, loss: torch.Tensor, mode: str) -> torch.Tensor:
        """:func:`agg_loss` of the per-token ``loss`` (T,) with ``mode``."""
        return agg_loss(loss, self.mask, self.cu_seqlens, mode, self.ctx, self.loss_scale_factor)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of ``values`` (T,) over this micro-batch's loss tokens (for metrics)."""
        return masked_mean(values, self.mask)
