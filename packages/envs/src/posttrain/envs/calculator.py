"""``calculator``: answer an arithmetic question, with a calculator tool to call.

The row's ``prompt`` is the first observation. The model may call ``calculator(expression)`` any number of
times; the first turn without a tool call ends the episode and scores 1.0 when the number after its last
``####`` equals the row's ground truth, else 0.0. ``latency_s`` and ``jitter_s`` make each call sleep first,
like a tool behind a network (``bench/agent_throughput.py`` uses them).
"""

from __future__ import annotations

import ast
import functools
import operator
import random
import re
import time
from collections.abc import Mapping
from typing import Any

from posttrain.core.env import Environment, Message, StepResult, Turn

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_ANSWER = re.compile(r"####\s*(-?[\d,.]+)")


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"unsupported expression element {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % and parentheses.

    Args:
        expression: The expression, e.g. "123 * 45".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval(ast.parse(expression, mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def final_answer(text: str) -> str | None:
    """The number after the last ``####`` in ``text`` (commas dropped), or None."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


class CalculatorEnv(Environment):
    """Arithmetic with a calculator tool; reward 1.0 for the right final answer."""

    tools = (calculator,)

    def __init__(
        self, max_tool_calls: int | None = None, latency_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0
    ) -> None:
        """``max_tool_calls``: end the episode (reward 0) after this many calls (None: no cap). ``latency_s``,
        ``jitter_s``: every call sleeps ``latency_s`` plus a uniform draw from ``[0, jitter_s]`` (from a
        ``random.Random(seed)`` of this episode) before it answers."""
        if max_tool_calls is not None and max_tool_calls < 1:
            raise ValueError(f"max_tool_calls={max_tool_calls} must be >= 1 or None")
        if latency_s < 0 or jitter_s < 0:
            raise ValueError(f"latency_s={latency_s} and jitter_s={jitter_s} must be >= 0")
        self.max_tool_calls = max_tool_calls
        if latency_s or jitter_s:
            rng = random.Random(seed)

            @functools.wraps(calculator)
            def slow_calculator(expression: str) -> str:
                time.sleep(latency_s + rng.uniform(0.0, jitter_s))
                return calculator(expression)

            self.tools = (slow_calculator,)
        self.calls = 0
        self.truth: str | None = None

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.truth = str(row["ground_truth"]).strip()
        self.calls = 0
        return super().reset(row)

    def step(self, turn: Turn) -> StepResult:
        self.calls += len(turn.tool_results)
        if turn.tool_results:
            if self.max_tool_calls is not None and self.calls >= self.max_tool_calls:
                return StepResult(reward=0.0, done=True)
            return StepResult()
        return StepResult(reward=float(final_answer(turn.text) == self.truth), done=True)
