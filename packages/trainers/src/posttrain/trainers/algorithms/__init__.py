"""RL algorithms on the packed layout: advantage estimators, policy losses, KL estimators and controllers,
loss aggregation, and the actor/critic loss functions engines run. Each is a small registered function whose
docstring gives its formula and source; see docs/algorithms.md. The configs and registries import without
torch; the functions' modules are imported when one of their names is first read."""

from typing import Any

from .config import (
    ActorLossConfig,
    AlgorithmConfig,
    CriticLossConfig,
    KLControlConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from .names import (
    ADV_ESTIMATORS,
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    EstimatorTraits,
    adv_estimator_traits,
)

# The torch functions, imported from their module on first access, so that the configs above load without
# torch.
_TORCH_NAMES = {
    "advantages": (
        "AdvantageInputs",
        "get_adv_estimator",
        "register_adv_estimator",
        "scores_to_token_rewards",
    ),
    "agg": ("LossTokens", "agg_loss"),
    "kl": (
        "AdaptiveKLController",
        "FixedKLController",
        "apply_kl_penalty",
        "get_kl_estimator",
        "kl_penalty",
        "register_kl_estimator",
    ),
    "losses": ("ActorLoss", "CriticLoss", "entropy_from_logits", "value_loss"),
    "packed": ("align_values",),
    "policy": ("PolicyLossInputs", "get_policy_loss", "register_policy_loss"),
    "rollout_correction": ("rollout_is_weights",),
}
_MODULE_OF = {name: module for module, names in _TORCH_NAMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ADV_ESTIMATORS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ActorLoss",
    "ActorLossConfig",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AlgorithmConfig",
    "CriticLoss",
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
    "entropy_from_logits",
    "get_adv_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "kl_penalty",
    "register_adv_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "rollout_is_weights",
    "scores_to_token_rewards",
    "value_loss",
]
