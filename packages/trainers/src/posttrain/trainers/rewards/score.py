"""Rule-based reward selection by ``data_source`` (verl's ``default_compute_score`` semantics).

``default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float``:

- ``openai/gsm8k``, ``gsm8k``: :func:`.gsm8k.compute_score` (strict ``#### <answer>``, exact match);
- ``synthetic_arithmetic``, ``synthetic_largest``, ``synthetic_calculator`` (posttrain's synthetic tasks): the
  same ``####`` rule;
- ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``, ``math``,
  ``math_dapo`` and ``aime*``: :func:`.math_boxed.compute_score` (last boxed answer, normalised). verl sends
  ``math``/``math_dapo``/``aime*`` to its DAPO scorer (``Answer:`` lines, rewards +1/-1); here they use the
  boxed scorer and score 1/0.

Any other source raises a ValueError that points at ``reward.custom_reward_function``.
"""

from __future__ import annotations

from typing import Any

from . import gsm8k, math_boxed

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k", "synthetic_arithmetic", "synthetic_largest", "synthetic_calculator")
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "math_dapo",
)


def has_rule(data_source: str) -> bool:
    """True when :func:`default_compute_score` has a rule for ``data_source``."""
    return data_source in GSM8K_SOURCES or data_source in MATH_SOURCES or data_source.startswith("aime")


def known_sources() -> str:
    """The data sources the rule-based scorers know, for messages."""
    return f"{', '.join(GSM8K_SOURCES)}, {', '.join(MATH_SOURCES)}, aime*"


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> float:
    """The rule-based score of one response for its data source."""
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, str(ground_truth))
    if data_source in MATH_SOURCES or data_source.startswith("aime"):
        return math_boxed.compute_score(solution_str, str(ground_truth))
    raise ValueError(
        f"no rule-based reward for data_source={data_source!r} (known: {known_sources()}): set "
        "reward.custom_reward_function=module:function"
    )
