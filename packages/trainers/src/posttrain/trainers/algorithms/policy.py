"""Policy-gradient losses on packed micro-batches, registered by ``actor.policy_loss.loss_mode``.

Every loss is ``fn(inputs, cfg)``: :class:`PolicyLossInputs` holds per-token (T,) ``old_log_prob`` (the policy
that sampled, recomputed by the actor before the update), ``log_prob`` (the policy being trained, with grad)
and ``advantages``, optional ``is_weights`` (the rollout correction, multiplying each token's loss), plus the
micro-batch's loss tokens (:class:`~.agg.LossTokens`: mask, ``cu_seqlens``, the step's
:class:`~posttrain.core.batch.LossContext`, the scale factor); ``cfg`` is the :class:`ActorLossConfig`. It
returns this micro-batch's share of the globally aggregated loss (see :mod:`.agg`) and local metrics (floats,
means over this micro-batch's loss tokens): ``actor/pg_clipfrac``, ``actor/ppo_kl`` (mean of ``old - new``
log-probs), ``actor/pg_clipfrac_lower``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .agg import LossTokens
from .config import ActorLossConfig, PolicyLossConfig
from .names import POLICY_LOSSES
from .packed import segment_sum, seq_index_from_cu

__all__ = ["POLICY_LOSSES", "ActorLossConfig", "PolicyLossConfig"]  # re-exported: their old import path


@dataclass(kw_only=True)
class PolicyLossInputs(LossTokens):
    """What a policy loss reads of one micro-batch (T = its tokens), besides its loss tokens."""

    old_log_prob: torch.Tensor
    """(T,) log-probs of the policy that sampled."""
    log_prob: torch.Tensor
    """(T,) log-probs of the policy being trained (with grad)."""
    advantages: torch.Tensor
    """(T,) advantages."""
    is_weights: torch.Tensor | None = None
    """(T,) rollout-correction weights (no grad) multiplying each token's loss before aggregation, or None
    (see :mod:`.rollout_correction`)."""

    def weighted(self, per_token: torch.Tensor) -> torch.Tensor:
        """``per_token`` times the rollout-correction weights (unchanged without them)."""
        return per_token if self.is_weights is None else per_token * self.is_weights


PolicyLossFn = Callable[[PolicyLossInputs, ActorLossConfig], tuple[torch.Tensor, dict[str, Any]]]
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get


def _metrics(clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor) -> dict[str, float]:
    return {
        "actor/pg_clipfrac": float(clipfrac),
        "actor/ppo_kl": float(ppo_kl),
        "actor/pg_clipfrac_lower": float(clipfrac_lower),
    }


@register_policy_loss("vanilla")
def vanilla(x: PolicyLossInputs, cfg: ActorLossConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO clipped surrogate with dual clip (Schulman et al. 2017, arXiv:1707.06347; Ye et al. 2020; verl
    ``compute_policy_loss_vanilla``). ``r = exp(clamp(logp - old, -20, 20))``,
    ``L1 = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` the loss is
    ``min(L1, -A clip_ratio_c)``, else ``L1``; aggregated with ``loss_agg_mode``."""
    adv = x.advantages
    neg_kl = torch.clamp(x.log_prob - x.old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * cfg.clip_ratio_c
    per_token = torch.where(adv < 0, torch.minimum(loss3, clipped), clipped)
    loss = x.agg(x.weighted(per_token), cfg.loss_agg_mode)
    with torch.no_grad():
        metrics = _metrics(
            x.mean((loss2 > loss1).float()),
            x.mean(-neg_kl),
            x.mean(((clipped > loss3) & (adv < 0)).float()),
        )
    return loss, metrics


@register_policy_loss("gspo")
def gspo(x: PolicyLossInputs, cfg: ActorLossConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071; verl
    ``compute_policy_loss_gspo``). Sequence ratio ``s_i = exp(mean_{t in i} (logp - old))``; per token
    ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))`` (value s_i, gradient of the token's log-prob) with the log
    clamped at 10; loss ``max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))``. Like verl it always
    aggregates with ``seq-mean-token-mean``, whatever ``loss_agg_mode`` says."""
    log_prob, mask = x.log_prob, x.mask
    seq_index = seq_index_from_cu(x.cu_seqlens.to(log_prob.device))
    num_seqs = x.cu_seqlens.numel() - 1
    neg_kl = log_prob - x.old_log_prob
    seq_len = segment_sum(mask.to(log_prob.dtype), seq_index, num_seqs).clamp(min=1)
    seq_neg_kl = segment_sum(neg_kl * mask, seq_index, num_seqs) / seq_len
    log_ratio = torch.clamp(log_prob - log_prob.detach() + seq_neg_kl.detach()[seq_index], max=10.0)
    ratio = torch.exp(log_ratio)
    loss1 = -x.advantages * ratio
    loss2 = -x.advantages * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = x.agg(x.weighted(torch.maximum(loss1, loss2)), "seq-mean-token-mean")
    with torch.no_grad():
        metrics = _metrics(x.mean((loss2 > loss1).float()), x.mean(-neg_kl), torch.zeros(()))
    return loss, metrics


@register_policy_loss("cispo")
def cispo(x: PolicyLossInputs, cfg: ActorLossConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585; verl
    ``compute_policy_loss_cispo``): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp`` with
    ``r = exp(clamp(logp - old, -20, 20))``: the weight is clipped but every token keeps its gradient.
    verl clips on both sides with clip_ratio_low/high (the paper mostly bounds the upper side only)."""
    neg_kl = torch.clamp(x.log_prob - x.old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    per_token = -clipped * x.advantages * x.log_prob
    loss = x.agg(x.weighted(per_token), cfg.loss_agg_mode)
    with torch.no_grad():
        metrics = _metrics(x.mean((ratio != clipped).float()), x.mean(-neg_kl), torch.zeros(()))
    return loss, metrics
