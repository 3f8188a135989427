"""``calculator``: answer an arithmetic question, with a calculator tool to call.

The row's ``prompt`` is the first observation. The model may call ``calculator(expression)`` any number of times;
the first turn without a tool call ends the episode and scores 1.0 when the number after its last ``####``
equals the row's ground truth, else 0.0.
"""

from __future__ import annotations

import ast
import operator
import re
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

    def __init__(self, max_tool_calls: int | None = None) -> None:
        """``max_tool_calls``: end the episode (reward 0) after this many calls (None: no cap)."""
        if max_tool_calls is not None and max_tool_calls < 1:
            raise ValueError(f"max_tool_calls={max_tool_calls} must be >= 1 or None")
        self.max_tool_calls = max_tool_calls
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
