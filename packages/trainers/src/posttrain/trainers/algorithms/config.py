"""The algorithm configs (verl's ``algorithm`` section and the actor's and critic's loss knobs), without
torch:
names are checked against the registries of :mod:`.names`; the functions they select live in the torch modules
(advantages, policy, kl, rollout_correction, losses)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .names import ADV_ESTIMATORS, CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, check_loss_agg_mode

if TYPE_CHECKING:
    import torch

    from .advantages import AdvantageInputs
    from .kl import FixedKLController
    from .losses import ActorLoss, CriticLoss

AdvantageEstimator = Callable[["AdvantageInputs"], "tuple[torch.Tensor, torch.Tensor]"]
"""``inputs -> (advantages, returns)``, each (T,): what :meth:`AlgorithmConfig.build_estimator` returns."""


@dataclass(kw_only=True)
class KLControlConfig:
    """The KL coefficient controller for ``algorithm.use_kl_in_reward`` (verl's ``algorithm.kl_ctrl``)."""

    type: str = "fixed"
    """``fixed`` or ``adaptive``."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient beta."""
    horizon: int = 10000
    """Adaptive: steps over which beta moves by at most 20 percent per unit of error."""
    target_kl: float = 0.1
    """Adaptive: the KL beta steers towards."""

    def __post_init__(self) -> None:
        if self.type not in ("fixed", "adaptive"):
            raise ValueError(f"algorithm.kl_ctrl.type={self.type!r}: use fixed or adaptive")
        if self.type == "adaptive" and (self.horizon <= 0 or self.target_kl <= 0):
            raise ValueError(
                f"algorithm.kl_ctrl.horizon={self.horizon} and target_kl={self.target_kl} must be > 0 "
                "for the adaptive controller"
            )

    def build(self) -> FixedKLController:
        """The controller: :class:`~.kl.AdaptiveKLController` or :class:`~.kl.FixedKLController`."""
        from .kl import AdaptiveKLController, FixedKLController

        if self.type == "adaptive":
            return AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)
        return FixedKLController(self.kl_coef)


LEVELS = ("token", "sequence")
OLD_LOG_PROB = ("recompute", "behaviour")


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """How the loss corrects for samples drawn by another policy than the proximal one (``algorithm.
    rollout_correction``)."""

    mode: str = "none"
    """none (no weight), tis (truncated at cap) or mis (zero outside [cap_low, cap])."""
    level: str = "token"
    """token (a ratio per token) or sequence (the geometric mean of the sequence's token ratios)."""
    cap: float = 2.0
    """Upper bound of the weight: tis truncates at it, mis masks above it (AReaL's behav_imp_weight_cap)."""
    cap_low: float = 0.0
    """mis only: weights below it are masked too (0: no lower bound)."""
    old_log_prob: str = "recompute"
    """recompute (the old-log-prob pass: the proximal policy is the trainer's weights before the update) or
    behaviour (skip the pass; the old log-probs are the rollout's, so the clip is taken around the
    sampler)."""

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        if self.mode != "none" and self.mode not in CORRECTIONS:
            raise ValueError(f"{key}.mode={self.mode!r}: choose none or one of {CORRECTIONS.names()}")
        if self.level not in LEVELS:
            raise ValueError(f"{key}.level={self.level!r}: choose one of {LEVELS}")
        if self.old_log_prob not in OLD_LOG_PROB:
            raise ValueError(f"{key}.old_log_prob={self.old_log_prob!r}: choose one of {OLD_LOG_PROB}")
        if self.cap <= 1.0:
            raise ValueError(
                f"{key}.cap={self.cap} must be > 1 (a weight cap below 1 down-weights every token)"
            )
        if not 0.0 <= self.cap_low < 1.0:
            raise ValueError(f"{key}.cap_low={self.cap_low} must lie in [0, 1)")
        if self.cap_low > 0 and self.mode != "mis":
            raise ValueError(f"{key}.cap_low={self.cap_low} only applies to mode=mis: set it to 0 or use mis")
        if self.mode != "none" and self.old_log_prob == "behaviour":
            raise ValueError(
                f"{key}.mode={self.mode} with old_log_prob=behaviour: the proximal policy is then the "
                "behaviour policy and every weight is 1; use old_log_prob=recompute or mode=none"
            )

    @property
    def enabled(self) -> bool:
        """True when a weight multiplies the loss."""
        return self.mode != "none"


@dataclass(kw_only=True)
class AlgorithmConfig:
    """RL algorithm knobs shared by actor and critic (verl's ``algorithm`` section, same names and
    defaults)."""

    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda."""
    adv_estimator: str = "gae"
    """gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline or remax."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std; false is Dr.GRPO (arXiv:2503.20783)."""
    use_kl_in_reward: bool = False
    """Subtract ``beta * kl(actor_old || ref)`` from each token's reward."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty: k1/kl, k2/mse, k3/low_var_kl, abs
    (``+`` = straight-through)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """How beta evolves."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights from the rollout's behaviour policy to the proximal one (off-policy samples)."""

    def __post_init__(self) -> None:
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r}: choose one of {ADV_ESTIMATORS.names()}"
            )
        if self.kl_penalty.rstrip("+") not in KL_ESTIMATORS:
            raise ValueError(
                f"algorithm.kl_penalty={self.kl_penalty!r}: choose one of {KL_ESTIMATORS.names()}"
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"algorithm.gamma={self.gamma} and algorithm.lam={self.lam} must lie in [0, 1]")

    def build_estimator(self) -> AdvantageEstimator:
        """The advantage estimator ``adv_estimator`` names, bound to this config: ``inputs -> (advantages,
        returns)``. A custom one must be registered (``register_adv_estimator``) before this is called."""
        from .advantages import get_adv_estimator

        estimator = get_adv_estimator(self.adv_estimator)

        def estimate(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
            return estimator(inputs, self)

        return estimate


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Which policy loss (verl's ``actor.policy_loss``)."""

    loss_mode: str = "vanilla"
    """vanilla (PPO clip + dual clip), gspo or cispo."""

    def __post_init__(self) -> None:
        if self.loss_mode not in POLICY_LOSSES:
            raise ValueError(
                f"actor.policy_loss.loss_mode={self.loss_mode!r}: choose one of {POLICY_LOSSES.names()}"
            )


@dataclass(kw_only=True)
class ActorLossConfig:
    """The actor's loss knobs, with verl's ``actor`` names and defaults (an actor config can extend this)."""

    clip_ratio: float = 0.2
    """PPO clip epsilon: the clip on both sides unless clip_ratio_low/high set one."""
    clip_ratio_low: float | None = None
    """Lower clip: ratio >= 1 - clip_ratio_low (None = clip_ratio)."""
    clip_ratio_high: float | None = None
    """Upper clip: ratio <= 1 + clip_ratio_high (None = clip_ratio; DAPO's clip-higher raises it)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound (Ye et al. 2020, arXiv:1912.09729) for negative advantages; must be > 1."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """Divisor of seq-mean-token-sum-norm; None = the rollout's response_length."""
    entropy_coeff: float = 0.0
    """Subtract entropy_coeff * entropy (aggregated like the loss); needs the engine's entropy output."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(actor || ref) to the loss (GRPO style) instead of KL in the reward."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: k1/kl, k2/mse, k3/low_var_kl, abs (``+`` = straight-through)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy loss."""

    def __post_init__(self) -> None:
        check_loss_agg_mode(self.loss_agg_mode, "actor.loss_agg_mode")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip lower bound)")
        if self.kl_loss_type.rstrip("+") not in KL_ESTIMATORS:
            raise ValueError(
                f"actor.kl_loss_type={self.kl_loss_type!r}: choose one of {KL_ESTIMATORS.names()}"
            )
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ValueError(f"actor.{key}={value} must be >= 0")

    def build_loss(self, loss_scale_factor: float | None = None) -> ActorLoss:
        """The actor's ``loss_fn(model_output, micro, ctx)`` for the engine; ``loss_scale_factor`` fills a
        None ``self.loss_scale_factor``."""
        from .losses import ActorLoss

        return ActorLoss(self, loss_scale_factor)

    @property
    def clip_low(self) -> float:
        """The lower clip in effect: clip_ratio_low, or clip_ratio when that is None."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """The upper clip in effect: clip_ratio_high, or clip_ratio when that is None."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(kw_only=True)
class CriticLossConfig:
    """The critic's loss knobs (verl's ``critic`` names and defaults)."""

    cliprange_value: float = 0.5
    """New values may move at most this far from the values the advantages used."""
    loss_agg_mode: str = "token-mean"
    """How the value loss is aggregated (same modes as the actor: token-mean, seq-mean-token-sum,
    seq-mean-token-mean or seq-mean-token-sum-norm)."""

    def __post_init__(self) -> None:
        check_loss_agg_mode(self.loss_agg_mode, "critic.loss_agg_mode")
        if self.cliprange_value < 0:
            raise ValueError(f"critic.cliprange_value={self.cliprange_value} must be >= 0")

    def build_loss(
        self, loss_scale_factor: float | None = None, align_model_values: bool = True
    ) -> CriticLoss:
        """The critic's ``loss_fn(model_output, micro, ctx)`` for the engine; with ``align_model_values`` the
        value-head outputs are aligned onto the next token first."""
        from .losses import CriticLoss

        return CriticLoss(self, loss_scale_factor, align_model_values)
