"""What every ``posttrain`` command shares: a bad config exits 2 with one line, and a config dataclass's
fields with their docstrings make its help."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from posttrain.core.config.loader import ConfigError


def exit_code(prog: str, command: Callable[[], Any]) -> int:
    """Run ``command``: its result when that is an int, else 0; or 2 after printing ``prog: <message>`` to
    stderr when it raises a :class:`~posttrain.core.config.loader.ConfigError`."""
    try:
        result = command()
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (read from its source), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def fields_help(cls: type) -> str:
    """``key=default`` and its docstring for each field of the dataclass ``cls``, one indented block each."""
    docs = field_docs(cls)
    lines = []
    for f in dataclasses.fields(cls):
        default = (
            f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        )
        lines.append(f"  {f.name}={default}")
        doc = " ".join(docs.get(f.name, "").split())
        lines += [f"      {line}" for line in textwrap.wrap(doc, 100)]
    return "\n".join(lines)
