"""KL estimators between the actor and the reference policy, and the KL-in-reward controllers.

Every estimator works on the log-probs of the sampled tokens only, ``d = logp - ref_logp`` per token
(Schulman, "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html; verl
``core_algos.kl_penalty``):

- ``k1`` (alias ``kl``): ``d``; unbiased for KL(actor || ref) but high variance and can be negative.
- ``abs``: ``|d|``.
- ``k2`` (alias ``mse``): ``0.5 d^2``; its gradient is the unbiased gradient of the KL.
- ``k3`` (alias ``low_var_kl``): ``exp(-d) - 1 + d``, non-negative and low variance; like verl, ``-d`` is
  clamped to [-20, 20] before the exponential and the result to [-10, 10].
- a ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``...) is verl's straight-through variant: the forward value
  of the named estimator with the gradient of ``k2``.

With ``algorithm.use_kl_in_reward`` the per-token rewards become ``score - beta * kl`` where ``beta`` comes
from a controller: fixed, or adaptive (Ziegler et al. 2019, arXiv:1909.08593): after each step
``beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .config import KLControlConfig
from .names import KL_ESTIMATORS
from .packed import masked_mean, segment_sum, seq_index_from_cu

__all__ = ["KLControlConfig", "KL_ESTIMATORS"]  # re-exported: their old import path
KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
register_kl_estimator = KL_ESTIMATORS.register


@register_kl_estimator("k1", "kl")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``logp - ref``."""
    return logprob - ref_logprob


@register_kl_estimator("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``."""
    return (logprob - ref_logprob).abs()


@register_kl_estimator("k2", "mse")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``0.5 (logp - ref)^2``."""
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``exp(ref - logp) - (ref - logp) - 1`` with ``ref - logp`` clamped to ±20 and the result to ±10."""
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


def get_kl_estimator(name: str) -> KLFn:
    """The estimator for ``name``, including the straight-through ``+`` variants."""
    if name.endswith("+"):
        forward = KL_ESTIMATORS.get(name[:-1])
        if forward is kl_k2:
            return kl_k2

        def straight_through(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
            grad_path = kl_k2(logprob, ref_logprob)
            return grad_path - grad_path.detach() + forward(logprob, ref_logprob).detach()

        return straight_through
    return KL_ESTIMATORS.get(name)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of type ``kind`` (see the module docstring)."""
    return get_kl_estimator(kind)(logprob, ref_logprob)


class FixedKLController:
    """beta stays ``kl_coef``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon (Ziegler et al. 2019)."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        super().__init__(kl_coef)
        self.target, self.horizon = target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    controller: FixedKLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``rewards = scores - beta * kl * mask`` per token, then update the controller with the batch KL.

    The batch KL is the mean over sequences of each sequence's mean KL over its response tokens (verl's
    ``apply_kl_penalty``) and the controller advances by ``n_steps`` = number of sequences. Pass the whole
    step's batch: the adaptive update is not additive over pieces.
    """
    kld = kl_penalty(old_log_probs, ref_log_probs, kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kld
    num_seqs = cu_seqlens.numel() - 1
    seq_index = seq_index_from_cu(cu_seqlens)
    per_seq = segment_sum(kld, seq_index, num_seqs) / segment_sum(mask, seq_index, num_seqs).clamp(min=1)
    current_kl = float(per_seq.mean())
    controller.update(current_kl, n_steps=num_seqs)
    return rewards, {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": beta,
        "actor/reward_kl_token_mean": float(masked_mean(kld, mask)),
    }
