"""Tool-call parsers: the calls in an assistant message, and the calls that could not be read.

``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere
in the message. ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole message is one JSON object
``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by ``;``. A block that
is not a JSON object with a string ``name`` and an object of arguments is a malformed call: the model is shown
the error and the episode goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from posttrain.core.env import ToolCall


@dataclass
class Parsed:
    """The calls of one message and the error text of each malformed one."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)


def _call(obj: Any, args_key: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'a tool call must be a JSON object with a string "name"'
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f'"{args_key}" of {obj["name"]} is a string that is not JSON'
    if not isinstance(args, dict):
        return f'"{args_key}" of {obj["name"]} must be a JSON object'
    return ToolCall(obj["name"], args)


def _decode(text: str, args_key: str, out: Parsed) -> None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        out.malformed.append(f"the tool call {text.strip()[:80]!r} is not valid JSON ({exc.msg})")
        return
    call = _call(obj, args_key)
    if isinstance(call, str):
        out.malformed.append(call)
    else:
        out.calls.append(call)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5)."""

    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        out = Parsed()
        for body in self._block.findall(text):
            _decode(body.strip(), "arguments", out)
        if text.count("<tool_call>") > text.count("</tool_call>"):
            out.malformed.append("a <tool_call> block is not closed with </tool_call>")
        return out


class Llama3JsonParser:
    """A message that is a JSON object ``{"name", "parameters"}`` (Llama 3.1 JSON tool calling)."""

    name = "llama3_json"

    def parse(self, text: str) -> Parsed:
        out = Parsed()
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return out
        for part in body.split(";") if "};" in body else [body]:
            _decode(part.strip(), "parameters", out)
        return out


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> HermesParser | Llama3JsonParser:
    if name not in PARSERS:
        raise ValueError(f"agent.parser={name!r} is unknown: use one of {', '.join(PARSERS)}")
    return PARSERS[name]()
