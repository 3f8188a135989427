"""Off-policy rollout correction: an importance weight from the behaviour policy to the proximal policy,
registered by ``algorithm.rollout_correction.mode``.

Three policies take part (AReaL's decoupled PPO, Fu et al. 2025, arXiv:2505.24298; verl's rollout correction):

- behaviour ``mu``: the rollout's log-probs of its own samples (``fields['rollout_log_probs']``), made by the
  weights of the policy version that generated them, with the rollout's kernels and dtype;
- proximal ``pi_old``: the trainer's log-probs before this step's update (``fields['old_log_probs']``, the
  old-log-prob pass);
- ``pi_theta``: the policy being trained.

The policy loss clips its ratio ``pi_theta / pi_old`` around the proximal policy, and a weight ``w`` of
``rho = pi_old / mu`` (no gradient) multiplies each token's policy loss before aggregation:

- ``tis`` (truncated IS; Ionides 2008, and Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): ``w = min(rho, cap)``;
- ``mis`` (masked IS, slime's and AReaL's form): ``w = rho`` where ``cap_low <= rho <= cap``, else 0, so a
  token (or sequence) the behaviour policy was too unlikely to sample drops out of the loss.

``level=token`` takes ``rho_t = exp(pi_old_t - mu_t)`` per token; ``level=sequence`` takes the geometric mean
over the sequence's response tokens, ``rho_i = exp(mean_{t in i} (pi_old_t - mu_t))``, and gives it to every
token of ``i`` (verl's ``geometric`` level; verl's ``sequence`` level is the product, which explodes with
length). The log ratio is clamped to [-20, 20] before ``exp``, as the PPO ratio is.

Decoupled PPO (AReaL) is ``mode=mis level=token cap=<behav_imp_weight_cap> cap_low=0`` with
``old_log_prob=recompute``: AReaL's loss is exactly ``w * max(-A r, -A clip(r))`` with
``r = pi_theta / pi_prox`` and ``w`` masked above the cap. ``mode=tis`` is its truncated variant (verl's
default "decoupled" correction).
Masked tokens stay in the loss denominator (the aggregation's global counts are fixed before the update, see
:mod:`.agg`); ``cap_low`` is an addition (AReaL masks above the cap only).

``old_log_prob=behaviour`` skips the old-log-prob pass (one forward over the batch, about a third of a
one-epoch update) and clips around the behaviour policy: standard PPO, whose old policy is the one that
sampled.
Then ``rho = 1``, so it is refused with tis/mis; the trainer also refuses it where the rollout's log-probs are
of another distribution than the trainer's (``top_p < 1`` or ``top_k``) or where the pass is needed (router
replay R2, which records its experts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import RolloutCorrectionConfig
from .names import CORRECTIONS
from .packed import segment_sum, seq_index_from_cu

CorrectionFn = Callable[[torch.Tensor, RolloutCorrectionConfig], tuple[torch.Tensor, torch.Tensor]]
register_correction = CORRECTIONS.register


@register_correction("tis")
def tis(rho: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS: ``(min(rho, cap), rho > cap)``."""
    return torch.clamp(rho, max=cfg.cap), rho > cfg.cap


@register_correction("mis")
def mis(rho: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked IS: ``(rho * keep, ~keep)`` with ``keep = cap_low <= rho <= cap``."""
    drop = (rho > cfg.cap) | (rho < cfg.cap_low)
    return torch.where(drop, torch.zeros_like(rho), rho), drop


def log_ratio(
    old_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    level: str,
) -> torch.Tensor:
    """(T,) ``log rho``: per token, or the sequence's mean over its response tokens on each of its tokens;
    clamped to [-20, 20] and 0 off the response."""
    delta = (old_log_prob - behaviour_log_prob) * mask
    if level == "sequence":
        seq_index = seq_index_from_cu(cu_seqlens.to(delta.device))
        num_seqs = cu_seqlens.numel() - 1
        count = segment_sum(mask.to(delta.dtype), seq_index, num_seqs).clamp(min=1)
        delta = (segment_sum(delta, seq_index, num_seqs) / count)[seq_index] * mask
    return torch.clamp(delta, -20.0, 20.0)


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(T,) weights (0 off the response) and their statistics over the response tokens:
    ``rollout/is_ratio/{mean,max}`` (``rho``), ``rollout/is_weight/mean`` and the share of tokens the cap
    acted on, ``rollout/is_weight/clipped_frac`` (tis) or ``masked_frac`` (mis)."""
    with torch.no_grad():
        rho = torch.exp(log_ratio(old_log_prob, behaviour_log_prob, mask, cu_seqlens, cfg.level))
        weights, hit = CORRECTIONS.get(cfg.mode)(rho, cfg)
        weights = weights * mask
        on = mask.bool()
        if not on.any():
            return weights, {}
        share = "clipped_frac" if cfg.mode == "tis" else "masked_frac"
        metrics = {
            "rollout/is_ratio/mean": float(rho[on].double().mean()),
            "rollout/is_ratio/max": float(rho[on].max()),
            "rollout/is_weight/mean": float(weights[on].double().mean()),
            f"rollout/is_weight/{share}": float(hit[on].double().mean()),
        }
    return weights, metrics
