"""The algorithm registries and the names a config may use, without torch: the built-in names are data here,
their functions are registered by the torch modules (advantages, policy, kl, rollout_correction) when first
needed, and a custom function registered with ``register_*`` before the config is built is accepted too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .registry import FunctionRegistry

_PKG = "posttrain.trainers.algorithms"

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_loss_agg_mode(mode: str, key: str = "loss_agg_mode") -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"{key}={mode!r}: choose one of {', '.join(LOSS_AGG_MODES)}")


@dataclass(frozen=True)
class EstimatorTraits:
    """What the RL loop must produce before an estimator can run (declared when it is registered)."""

    needs_critic: bool = False
    """Per-token ``values`` from a critic: the loop builds, runs and trains a critic (``critic.*``)."""
    needs_greedy_baseline: bool = False
    """Per-sequence ``reward_baselines``, the reward of a greedy response to the same prompt: the loop
    generates one per prompt each step."""


ADV_ESTIMATORS: FunctionRegistry[Callable[..., Any]] = FunctionRegistry(
    "advantage estimator",
    "algorithm.adv_estimator",
    builtin=("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"),
    module=f"{_PKG}.advantages",
    default_traits=EstimatorTraits(),
)
POLICY_LOSSES: FunctionRegistry[Callable[..., Any]] = FunctionRegistry(
    "policy loss",
    "actor.policy_loss.loss_mode",
    builtin=("vanilla", "gspo", "cispo"),
    module=f"{_PKG}.policy",
)
KL_ESTIMATORS: FunctionRegistry[Callable[..., Any]] = FunctionRegistry(
    "KL estimator",
    "kl_penalty / kl_loss_type",
    builtin=("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"),
    module=f"{_PKG}.kl",
)
CORRECTIONS: FunctionRegistry[Callable[..., Any]] = FunctionRegistry(
    "rollout correction",
    "algorithm.rollout_correction.mode",
    builtin=("tis", "mis"),
    module=f"{_PKG}.rollout_correction",
)


def adv_estimator_traits(name: str) -> EstimatorTraits:
    """The traits estimator ``name`` was registered with; a ValueError listing the names if unknown."""
    return ADV_ESTIMATORS.traits(name)
