"""Rewards: rule-based scorers chosen by data_source (gsm8k and the synthetic task: the answer after ``####``;
math: the last boxed answer, normalised), user reward functions given as ``module:function``, and reward
metrics."""

from .custom import load_reward_fn
from .manager import RewardConfig, RewardManager, RewardResult, reward_metrics
from .score import default_compute_score

__all__ = [
    "RewardConfig",
    "RewardManager",
    "RewardResult",
    "default_compute_score",
    "load_reward_fn",
    "reward_metrics",
]
