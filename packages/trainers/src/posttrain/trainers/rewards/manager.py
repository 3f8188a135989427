"""Score a batch of decoded responses and summarise the rewards as metrics.

:class:`RewardManager` calls the configured scorer once per response (verl's ``naive`` reward manager): the
rule-based :func:`.score.default_compute_score`, or the user function of ``reward.custom_reward_function``.
A scorer returns a number, a bool, or a dict with a ``score`` key whose other keys are collected per sample.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .custom import load_reward_fn
from .score import default_compute_score


@dataclass(kw_only=True)
class RewardConfig:
    """Where rewards come from."""

    custom_reward_function: str | None = None
    """``module:function`` or ``path/to/file.py:function``; None = the rule-based scorer chosen by
    data_source."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the custom function."""


@dataclass
class RewardResult:
    """Scores of a batch, in input order."""

    scores: list[float]
    extras: dict[str, list[Any]]


class RewardManager:
    """Scores responses with the rule-based scorer or a user function."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        fn: Callable[..., Any] = default_compute_score
        if config.custom_reward_function:
            fn = load_reward_fn(config.custom_reward_function)
        self.fn = fn

    def score_one(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> tuple[float, dict[str, Any]]:
        kwargs = self.config.reward_kwargs if self.fn is not default_compute_score else {}
        out = self.fn(data_source, solution_str, ground_truth, extra_info, **kwargs)
        extra: dict[str, Any] = {}
        if isinstance(out, dict):
            if "score" not in out:
                raise ValueError(
                    f"reward function returned a dict without 'score' (keys {sorted(out)}): return "
                    "a number or {'score': ..., ...}"
                )
            extra = {k: v for k, v in out.items() if k != "score"}
            out = out["score"]
        if not isinstance(out, (int, float)) or not math.isfinite(float(out)):
            raise ValueError(
                f"reward function returned {out!r} for data_source={data_source!r}: it must be a finite "
                "number"
            )
        return float(out), extra

    def __call__(
        self,
        data_sources: Sequence[str],
        solutions: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
    ) -> RewardResult:
        if not len(data_sources) == len(solutions) == len(ground_truths):
            raise ValueError(
                f"reward inputs differ in length: {len(data_sources)} data sources, {len(solutions)} "
                f"solutions, {len(ground_truths)} ground truths"
            )
        infos = extra_infos if extra_infos is not None else [None] * len(solutions)
        scores: list[float] = []
        extras: dict[str, list[Any]] = defaultdict(list)
        for i, (source, sol, truth, info) in enumerate(zip(data_sources, solutions, ground_truths, infos)):
            score, extra = self.score_one(source, sol, truth, info)
            scores.append(score)
            for key, value in extra.items():
                extras[key].extend([None] * (i - len(extras[key])) + [value])
        return RewardResult(scores, {k: v + [None] * (len(scores) - len(v)) for k, v in extras.items()})


def reward_metrics(
    scores: Sequence[float],
    data_sources: Sequence[str] | None = None,
    uids: Sequence[Any] | None = None,
    prefix: str = "reward",
) -> dict[str, float]:
    """``{prefix}/mean, std, min, max, positive_frac``; per data source ``{prefix}/<source>/mean`` when there
    are several; with group ids, ``{prefix}/group_any_positive`` (share of prompts with a positive sample,
    pass@n for 0/1 rewards) and ``{prefix}/group_all_same`` (share of prompts whose samples all scored the
    same: they carry no GRPO signal)."""
    if not scores:
        return {}
    n = len(scores)
    mean = sum(scores) / n
    out = {
        f"{prefix}/mean": mean,
        f"{prefix}/std": math.sqrt(sum((s - mean) ** 2 for s in scores) / n),
        f"{prefix}/min": min(scores),
        f"{prefix}/max": max(scores),
        f"{prefix}/positive_frac": sum(1 for s in scores if s > 0) / n,
    }
    if data_sources is not None and len(set(data_sources)) > 1:
        by_source: dict[str, list[float]] = defaultdict(list)
        for s, src in zip(scores, data_sources):
            by_source[src].append(s)
        out.update({f"{prefix}/{src}/mean": sum(v) / len(v) for src, v in sorted(by_source.items())})
    if uids is not None:
        groups: dict[Any, list[float]] = defaultdict(list)
        for s, uid in zip(scores, uids):
            groups[uid].append(s)
        out[f"{prefix}/group_any_positive"] = sum(1 for g in groups.values() if max(g) > 0) / len(groups)
        out[f"{prefix}/group_all_same"] = sum(1 for g in groups.values() if len(set(g)) == 1) / len(groups)
    return out
