"""GSM8K-style scoring: the answer is the number after ``####`` (verl ``reward_score/gsm8k.py`` semantics).

``strict``: the last ``#### <number>`` in the last 300 characters of the response, with ``,`` and ``$``
removed, must equal the ground truth string exactly. ``flexible``: the last number anywhere in the response.
A response with no answer scores 0; a wrong answer scores ``format_score`` (0 by default); a right one
``score``.
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_CLIP_CHARS = 300


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer the response gives, or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method {method!r}: use strict or flexible")
    tail = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "").replace("$", "") if matches else None
    candidates = [m for m in _NUMBER.findall(tail) if m not in ("", ".")]
    return candidates[-1].replace(",", "").replace("$", "") if candidates else None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` when the extracted answer equals ``ground_truth``, ``format_score`` when an answer is there
    but wrong, 0 when there is none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).strip() else format_score
