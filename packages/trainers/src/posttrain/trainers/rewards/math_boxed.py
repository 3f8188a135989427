r"""MATH-style scoring: the last ``\boxed{...}`` (or ``\fbox{...}``) answer, normalised, against the ground
truth.

Normalisation follows the Hendrycks MATH / lm-eval-harness ``strip_string`` that verl's ``math_reward`` uses:
drop line breaks, ``\!``, ``\left``/``\right``, degrees, ``\$``/``$``, a trailing ``\text{ unit}``, ``\%``;
``tfrac``/``dfrac`` -> ``frac``; a leading ``x =`` (short left side) is dropped; ``\sqrt3`` -> ``\sqrt{3}``;
``\frac12`` -> ``\frac{1}{2}``; spaces removed; an integer ``a/b`` -> ``\frac{a}{b}``. Beyond verl, two
answers that both read as plain rational numbers (``-3``, ``2.50``, ``7.0``, ``1,000``, ``3/4``,
``\frac{3}{4}``, ``0.75``) are compared by value, so trailing ``.0`` and fraction/decimal spellings match.
"""

from __future__ import annotations

import re
from fractions import Fraction


def last_boxed_only_string(text: str) -> str | None:
    r"""The last ``\boxed{...}``/``\fbox{...}`` with balanced braces, or ``\boxed x`` up to a ``$``; else
    None."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):
        return "\\boxed " + text[idx + len("\\boxed ") :].split("$")[0]
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    r"""The content of ``\boxed{...}``, ``\fbox{...}`` or ``\boxed x``."""
    for prefix in ("\\boxed ",):
        if boxed.startswith(prefix):
            return boxed[len(prefix) :].strip()
    for prefix in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix) and boxed.endswith("}"):
            return boxed[len(prefix) : -1]
    return boxed


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part or part[0] == "{" or len(part) < 2:
            out += part
        elif part[1] == "{":
            out += "{" + part[0] + "}" + part[1:]
        else:
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return out


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(?!\{)(\w)", r"\\sqrt{\1}", s)


def _fix_a_slash_b(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def strip_string(s: str) -> str:
    """Canonical form of a MATH answer (see the module docstring)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    if "\\text{ " in s:
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def as_number(s: str) -> Fraction | None:
    r"""The value of a plain rational answer (``-12``, ``2.50``, ``1,000``, ``3/4``, ``\frac{3}{4}``), else
    None."""
    s = s.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s) or re.fullmatch(r"(-?)(-?\d+)/(\d+)", s)
    if m:
        if int(m.group(3)) == 0:
            return None
        value = Fraction(int(m.group(2)), int(m.group(3)))
        return -value if m.group(1) else value
    if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def is_equiv(answer: str | None, truth: str | None) -> bool:
    """Equal after :func:`strip_string`, or equal as rational numbers."""
    if answer is None or truth is None:
        return False
    a, b = strip_string(answer), strip_string(truth)
    if a == b:
        return True
    va, vb = as_number(a), as_number(b)
    return va is not None and va == vb


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 when the last boxed answer is equivalent to ``ground_truth`` (itself boxed or bare), else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    truth = str(ground_truth)
    truth_boxed = last_boxed_only_string(truth)
    if truth_boxed is not None:
        truth = remove_boxed(truth_boxed)
    return 1.0 if is_equiv(remove_boxed(boxed), truth) else 0.0
