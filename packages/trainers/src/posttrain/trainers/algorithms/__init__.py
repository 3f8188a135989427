"""RL algorithms on the packed layout: advantage estimators, policy losses, KL estimators and controllers,
loss aggregation, and the actor/critic loss functions engines run. Each is a small registered function whose
docstring gives its formula and source; see docs/algorithms.md."""

from .advantages import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    AlgorithmConfig,
    EstimatorTraits,
    adv_estimator_traits,
    compute_advantage,
    get_adv_estimator,
    register_adv_estimator,
    scores_to_token_rewards,
)
from .agg import LOSS_AGG_MODES, LossTokens, agg_loss
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    apply_kl_penalty,
    get_kl_controller,
    get_kl_estimator,
    kl_penalty,
    register_kl_estimator,
)
from .losses import CriticLossConfig, entropy_from_logits, make_actor_loss, make_critic_loss, value_loss
from .packed import align_values
from .policy import (
    POLICY_LOSSES,
    ActorLossConfig,
    PolicyLossConfig,
    PolicyLossInputs,
    get_policy_loss,
    register_policy_loss,
)
from .rollout_correction import CORRECTIONS, RolloutCorrectionConfig, rollout_is_weights

__all__ = [
    "ADV_ESTIMATORS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ActorLossConfig",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AlgorithmConfig",
    "CriticLossConfig",
    "EstimatorTraits",
    "FixedKLController",
    "KLControlConfig",
    "LossTokens",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "RolloutCorrectionConfig",
    "adv_estimator_traits",
    "agg_loss",
    "align_values",
    "apply_kl_penalty",
    "compute_advantage",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_kl_controller",
    "get_kl_estimator",
    "get_policy_loss",
    "kl_penalty",
    "make_actor_loss",
    "make_critic_loss",
    "register_adv_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "rollout_is_weights",
    "scores_to_token_rewards",
    "value_loss",
]
