"""The environment contract of multi-turn RL: what an agent talks to, and the tools it may call.

An :class:`Environment` is built once per episode (``cls(**kwargs)``, kwargs from the data row's
``extra_info.env_kwargs``). ``reset(row)`` gives the first observation (chat messages; the default is the
row's ``prompt``); after every assistant turn the agent loop runs the turn's tool calls (plain Python
functions listed in ``tools``) and calls ``step(turn)``, which returns more messages, an optional reward and
whether the episode is over. The JSON schema the model sees for a tool comes from its typed signature and its
docstring (:func:`tool_schema`).

Environments register by name in the ``posttrain.environments`` entry-point group
(``calculator = "posttrain.envs.calculator:CalculatorEnv"``) and are found with :func:`environment_class`.
This module lives in engine-core so that a package of environments depends on engine-core alone, not on the
trainers.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from .registry import ConfigRegistry, load_target

ENVIRONMENT_GROUP = "posttrain.environments"

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (tool results also carry ``name``)."""


@dataclass
class ToolCall:
    """One call the model asked for."""

    name: str
    """The tool's name."""
    arguments: dict[str, Any]
    """Keyword arguments."""


@dataclass
class ToolResult:
    """What one call returned, or the error the model is shown instead."""

    name: str
    """The tool's name (as the model wrote it)."""
    content: str
    """The text the model sees: the tool's return value, or the error message."""
    error: str | None = None
    """None on success, else the failure kind: ``malformed``, ``unknown_tool``, ``raised`` or ``timeout``."""


@dataclass
class Turn:
    """One assistant turn as the environment sees it."""

    text: str
    """The decoded assistant message."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The calls parsed from it."""
    tool_results: list[ToolResult] = field(default_factory=list)
    """Their results (one per call, plus one per malformed call), already shown to the model."""


@dataclass
class StepResult:
    """What the environment answers to a turn."""

    observation: list[Message] = field(default_factory=list)
    """Messages appended after the tool results (user turns, feedback); may be empty."""
    reward: float | None = None
    """The episode's reward, when ``done`` (None: the trainer's reward function scores the trajectory)."""
    done: bool = False
    """The episode is over."""


class Environment:
    """Base class of environments. Override :meth:`step` (and :meth:`reset` when the row's prompt is not the
    first observation); list the tools the model may call in ``tools``."""

    tools: Sequence[Callable[..., Any]] = ()
    """Plain functions the model may call by name; their signature and docstring give the schema."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The first observation: the row's ``prompt`` chat (``row`` holds ``prompt``, ``data_source``,
        ``ground_truth`` and ``extra_info``)."""
        return [dict(m) for m in row["prompt"]]

    def step(self, turn: Turn) -> StepResult:
        """The default: a turn without tool calls ends the episode (reward None: the reward function scores
        it); a turn with calls continues with their results."""
        return StepResult(done=not turn.tool_calls and not turn.tool_results)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI-style function schema of every tool, for the chat template's ``tools=``."""
        return [tool_schema(fn) for fn in self.tools]


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0], where)
        return {"anyOf": [_json_type(a, where) for a in args]}
    if origin in (list, Sequence):
        (item,) = typing.get_args(annotation) or (str,)
        return {"type": "array", "items": _json_type(item, where)}
    base = origin or annotation
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    raise ValueError(f"{where} has type {annotation!r}: use str, int, float, bool, list or dict")


def _arg_docs(doc: str) -> dict[str, str]:
    """``name: text`` lines of a Google-style ``Args:`` section."""
    out, inside = {}, False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside = True
            continue
        if inside:
            m = re.match(r"\s+(\w+)(?:\s*\(.*?\))?:\s*(.*)", line)
            if m:
                out[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith(" "):
                inside = False
    return out


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {name, description, parameters}}`` of ``fn``: every parameter must
    be annotated; the docstring's first paragraph is the description and its ``Args:`` lines describe the
    parameters; parameters without a default are required."""
    name = getattr(fn, "__name__", None)
    doc = inspect.getdoc(fn)
    if not name or not doc:
        raise ValueError(f"tool {fn!r} needs a name and a docstring (the model reads them)")
    hints = typing.get_type_hints(fn)
    arg_docs = _arg_docs(doc)
    props, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        if pname not in hints:
            raise ValueError(f"tool {name}: parameter {pname!r} has no type annotation; annotate it")
        props[pname] = _json_type(hints[pname], f"tool {name}: parameter {pname!r}")
        if pname in arg_docs:
            props[pname]["description"] = arg_docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


class EnvironmentRegistry(ConfigRegistry):
    """environment name -> :class:`Environment` subclass, from the ``posttrain.environments`` group."""

    def __init__(self, targets: dict[str, str] | None = None) -> None:
        super().__init__(ENVIRONMENT_GROUP, targets)

    @classmethod
    def from_entry_points(cls, group: str = ENVIRONMENT_GROUP) -> EnvironmentRegistry:
        reg = cls()
        for ep in entry_points(group=group):
            reg.register(ep.name, ep.value, source=ep.dist.name if ep.dist is not None else "?")
        return reg

    def get_environment_cls(self, name: str) -> type[Environment]:
        """The class registered as ``name``, or the class ``name`` points at when written ``module:Class``."""
        if ":" in name:
            self.register(name, name)
        if name not in self._targets:
            raise ValueError(
                f"no environment named {name!r} (installed environments: "
                f"{', '.join(self.names()) or 'none'}): install the package that registers it in the "
                f"{self.group} entry-point group (posttrain-envs has calculator), or pick one of those"
            )
        cls = load_target(self._targets[name])
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"{self._targets[name]} ({self.group} {name}) is not an Environment subclass")
        return cls


def environment_class(name: str) -> type[Environment]:
    """The installed environment class registered as ``name``; a ValueError listing those there are."""
    return EnvironmentRegistry.from_entry_points().get_environment_cls(name)
