"""Advantage estimators on the packed layout, registered by name (``algorithm.adv_estimator``).

Inputs (:class:`AdvantageInputs`): per-token ``token_level_rewards`` (T,), ``response_mask`` (T,), the batch's
``cu_seqlens`` (B+1,), per-sequence group ids ``index`` (B,) (the ``uid`` shared by the n samples of one
prompt), and where an estimator needs them per-token ``values`` (T,) or per-sequence ``reward_baselines``
(B,).
A sequence is ``prompt + response``; only response tokens (mask 1) carry rewards and get advantages. For
outcome rewards the score sits on the last response token (:func:`scores_to_token_rewards`) and an outcome
estimator's score is the sum of a sequence's response rewards, so KL-in-reward penalties are included.
``values[t]`` is the critic's value of the state in which token ``t`` is generated (aligned with the token,
like ``log_probs[t]``). Outputs are (advantages (T,), returns (T,)), both 0 outside the response.

Estimators that whiten (gae, reinforce_plus_plus, reinforce_plus_plus_baseline) and group estimators normalise
over the batch they are given: call them once on the whole step's batch, before splitting it over
data-parallel ranks or mini-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import AlgorithmConfig
from .names import ADV_ESTIMATORS, EstimatorTraits, adv_estimator_traits
from .packed import (
    from_padded,
    last_token_positions,
    masked_whiten,
    segment_sum,
    seq_index_from_cu,
    to_padded,
)

__all__ = ["ADV_ESTIMATORS", "AlgorithmConfig", "EstimatorTraits", "adv_estimator_traits"]  # old import path


@dataclass
class AdvantageInputs:
    """What an estimator may read; shapes T = tokens, B = sequences."""

    token_level_rewards: torch.Tensor
    """(T,) rewards; nonzero only on response tokens."""
    response_mask: torch.Tensor
    """(T,) 1 on response tokens."""
    cu_seqlens: torch.Tensor
    """(B+1,) sequence boundaries."""
    index: torch.Tensor | None = None
    """(B,) group id (uid) of each sequence; the group estimators need it."""
    values: torch.Tensor | None = None
    """(T,) critic values (gae)."""
    reward_baselines: torch.Tensor | None = None
    """(B,) reward of the greedy response to the same prompt (remax)."""

    @classmethod
    def from_scores(
        cls,
        scores: torch.Tensor,
        response_mask: torch.Tensor,
        cu_seqlens: torch.Tensor,
        **kwargs: torch.Tensor,
    ) -> AdvantageInputs:
        """Inputs for outcome rewards: one score (B,) per sequence, put on its last response token."""
        return cls(
            scores_to_token_rewards(scores, response_mask, cu_seqlens), response_mask, cu_seqlens, **kwargs
        )

    def require(self, name: str, estimator: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"adv_estimator={estimator!r} needs {name}: pass AdvantageInputs({name}=...)")
        return value

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def scores(self) -> torch.Tensor:
        """(B,) sum of each sequence's response rewards."""
        mask = self.response_mask.to(self.token_level_rewards.dtype)
        return segment_sum(self.token_level_rewards * mask, seq_index_from_cu(self.cu_seqlens), self.num_seqs)

    def broadcast(self, per_seq: torch.Tensor) -> torch.Tensor:
        """(B,) -> (T,) on response tokens, 0 elsewhere."""
        return per_seq[seq_index_from_cu(self.cu_seqlens)] * self.response_mask


AdvantageFn = Callable[[AdvantageInputs, AlgorithmConfig], tuple[torch.Tensor, torch.Tensor]]
register_adv_estimator = ADV_ESTIMATORS.register
get_adv_estimator = ADV_ESTIMATORS.get


def scores_to_token_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """(T,) rewards holding each sequence's score on its last response token (verl's token_level_scores)."""
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    last = last_token_positions(response_mask, cu_seqlens)
    has = last >= 0
    out[last[has]] = scores[has]
    return out


def group_stats(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, unbiased group std, group size); a group of one has std 0."""
    _, inverse = torch.unique(index, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add(
        0, inverse, torch.ones_like(scores)
    )
    mean = torch.zeros_like(count).index_add(0, inverse, scores) / count
    sq = torch.zeros_like(count).index_add(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[inverse], std[inverse], count[inverse]


@register_adv_estimator("gae", traits=EstimatorTraits(needs_critic=True))
def gae(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438; verl
    ``compute_gae_advantage_return``). Over the response tokens t_1 < ... < t_n of a sequence (non-response
    tokens are skipped, so multi-turn observations do not break the chain):
    ``delta_k = r_k + gamma * V_{k+1} - V_k`` (V_{n+1} = 0), ``A_k = sum_l (gamma*lam)^l delta_{k+l}``,
    ``returns = A + V``; advantages are then whitened over all response tokens of the batch."""
    values = inputs.require("values", "gae")
    cu, mask = inputs.cu_seqlens, inputs.response_mask
    rewards, vals, m = to_padded(inputs.token_level_rewards, cu), to_padded(values, cu), to_padded(mask, cu)
    next_value = torch.zeros_like(vals[:, 0])
    last_gae = torch.zeros_like(vals[:, 0])
    advantages = torch.zeros_like(vals)
    for t in reversed(range(vals.shape[1])):
        delta = rewards[:, t] + cfg.gamma * next_value - vals[:, t]
        new_gae = delta + cfg.gamma * cfg.lam * last_gae
        next_value = torch.where(m[:, t] > 0, vals[:, t], next_value)
        last_gae = torch.where(m[:, t] > 0, new_gae, last_gae)
        advantages[:, t] = last_gae
    adv = from_padded(advantages, cu)
    returns = (adv + values) * mask
    return masked_whiten(adv, mask) * mask, returns


@register_adv_estimator("grpo")
def grpo(
    inputs: AdvantageInputs, cfg: AlgorithmConfig, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300; verl ``compute_grpo_outcome_advantage``):
    ``A_i = (s_i - mean_g) / (std_g + 1e-6)`` over the group g of sequence i (unbiased std), or
    ``A_i = s_i - mean_g`` when ``norm_adv_by_std_in_grpo`` is false (Dr.GRPO, arXiv:2503.20783). A group of
    one sample gets mean 0 and std 1 (verl's convention: its raw score). Same value on every response
    token."""
    index = inputs.require("index", "grpo")
    scores = inputs.scores()
    mean, std, count = group_stats(scores, index)
    single = count == 1
    mean, std = torch.where(single, 0.0, mean), torch.where(single, 1.0, std)
    adv = (scores - mean) / (std + epsilon) if cfg.norm_adv_by_std_in_grpo else scores - mean
    adv = inputs.broadcast(adv)
    return adv, adv


@register_adv_estimator("rloo")
def rloo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740; verl
    ``compute_rloo_outcome_advantage``):
    ``A_i = s_i - mean_{j != i} s_j = n/(n-1) (s_i - mean_g)`` for a group of n > 1; a group of one keeps its
    raw score (verl's loop version; its vectorised variant gives 0 there)."""
    index = inputs.require("index", "rloo")
    scores = inputs.scores()
    mean, _, count = group_stats(scores, index)
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), scores)
    adv = inputs.broadcast(adv)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; verl ``compute_reinforce_plus_plus_outcome_advantage``):
    discounted return ``G_t = r_t + gamma * G_{t+1}`` over a sequence's tokens from the end, reset to 0 after
    each non-response token (so the prompt gets nothing), then whitened over all response tokens of the batch.
    Returns are ``G``."""
    cu, mask = inputs.cu_seqlens, inputs.response_mask
    rewards, m = to_padded(inputs.token_level_rewards, cu), to_padded(mask, cu)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + cfg.gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    ret = from_padded(returns, cu) * mask
    return masked_whiten(ret, mask) * mask, ret


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    inputs: AdvantageInputs, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (arXiv:2501.03262; verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``): ``s_i - mean_g`` (0 baseline for a group of
    one) on every response token, then whitened over all response tokens of the batch."""
    index = inputs.require("index", "reinforce_plus_plus_baseline")
    scores = inputs.scores()
    mean, _, count = group_stats(scores, index)
    centred = inputs.broadcast(scores - torch.where(count > 1, mean, 0.0))
    adv = masked_whiten(centred, inputs.response_mask) * inputs.response_mask
    return adv, adv


@register_adv_estimator("remax", traits=EstimatorTraits(needs_greedy_baseline=True))
def remax(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505; verl ``compute_remax_outcome_advantage``): the undiscounted
    reward-to-go ``G_t = sum_{t' >= t} r_t'`` over response tokens minus the greedy response's reward
    ``b`` (``reward_baselines``): ``A_t = G_t - b``. No whitening. Returns are ``G``."""
    baselines = inputs.require("reward_baselines", "remax")
    cu, mask = inputs.cu_seqlens, inputs.response_mask
    padded = to_padded(inputs.token_level_rewards * mask, cu)
    returns = from_padded(padded.flip(-1).cumsum(-1).flip(-1), cu) * mask
    return returns - inputs.broadcast(baselines.to(returns.dtype)), returns
