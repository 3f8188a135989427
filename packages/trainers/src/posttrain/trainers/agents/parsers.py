"""Tool-call parsers: the calls in an assistant message, and the calls that could not be read.

``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
anywhere in the message. ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole message is one JSON
object ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by
``;``.
``qwen3_coder`` (Qwen3-Coder, Qwen3.5):
``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function> </tool_call>`` blocks whose values
are raw text, typed by the tools' JSON schemas (:class:`Qwen3CoderParser`). A block that cannot be read as a
call is a malformed call: the model is shown the error and the episode goes on.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


Schemas = Sequence[dict[str, Any]] | None
"""The tools' OpenAI-style schemas (``Environment.tool_schemas()``), or None when unknown."""


class Parser(Protocol):
    """Reads the tool calls of one assistant message; ``tools`` are the schemas the chat template rendered."""

    name: str

    def parse(self, text: str, tools: Schemas = None) -> Parsed: ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5); the JSON carries its own types."""

    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: Schemas = None) -> Parsed:
        out = Parsed()
        for body in self._block.findall(text):
            _decode(body.strip(), "arguments", out)
        if text.count("<tool_call>") > text.count("</tool_call>"):
            out.malformed.append("a <tool_call> block is not closed with </tool_call>")
        return out


class Llama3JsonParser:
    """A message that is a JSON object ``{"name", "parameters"}`` (Llama 3.1 JSON tool calling)."""

    name = "llama3_json"

    def parse(self, text: str, tools: Schemas = None) -> Parsed:
        out = Parsed()
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return out
        for part in body.split(";") if "};" in body else [body]:
            _decode(part.strip(), "parameters", out)
        return out


_KNOWN = ("string", "integer", "number", "boolean", "object", "array", "null")
_NAMED = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean (true or false)",
    "object": "a JSON object",
    "array": "a JSON array",
    "null": "null",
}
_NOT = object()
"""What a decoder returns for text that is not of its type."""


def _properties(tools: Schemas) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters' schemas, from ``{"type": "function", "function": {...}}`` schemas (or the
    bare function objects, which the chat templates take too)."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn.get("name")] = props if isinstance(props, dict) else {}
    return out


def _kinds(schema: Any) -> list[str]:
    """The types a parameter's schema allows, in order: its ``type`` (a name or a list), else its ``anyOf`` or
    ``oneOf`` alternatives' types; a schema that names none is a string (as vLLM reads it)."""
    if not isinstance(schema, dict):
        return ["string"]
    if "type" in schema:
        kind = schema["type"]
        return [str(k) for k in kind] if isinstance(kind, list) else [str(kind)]
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alternatives, list):
        return [k for alt in alternatives for k in _kinds(alt)] or ["string"]
    return ["string"]


def _literal(text: str) -> Any:
    """``text`` as JSON, else as a Python literal (older Qwen3-Coder templates wrote values with Python's
    ``str``:
    ``True``, ``{'a': 1}``); :data:`_NOT` when it is neither."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT


def _as_kind(text: str, kind: str) -> Any:
    """``text`` as a value of the JSON-schema type ``kind``, or :data:`_NOT`."""
    if kind == "string":
        return text
    word = text.strip().lower()
    if kind == "null":
        return None if word == "null" else _NOT
    if kind == "boolean":
        return word == "true" if word in ("true", "false") else _NOT
    value = _literal(text)
    wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}[kind]
    return value if isinstance(value, wanted) and not isinstance(value, bool) else _NOT


def _typed(text: str, schema: Any) -> Any:
    """``text`` as the first of its schema's types that decodes it (string last); ``null`` is None whatever
    the type. A ValueError, worded to follow the parameter's name, when none does or a type is not JSON
    schema's."""
    kinds = _kinds(schema)
    unknown = [k for k in kinds if k not in _KNOWN]
    if unknown:
        raise ValueError(
            f"has the schema type {unknown[0]!r}, which the qwen3_coder parser cannot decode (it decodes "
            f"{', '.join(_KNOWN)})"
        )
    if text.strip().lower() == "null":
        return None
    for kind in sorted(kinds, key=lambda k: k == "string"):
        value = _as_kind(text, kind)
        if value is not _NOT:
            return value
    raise ValueError(f"is {text[:80]!r}, which is not {' or '.join(_NAMED[k] for k in kinds)}")


_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
_OPEN_PARAMETER = re.compile(r"<parameter=([^>]*)>")


def _raw(value: str) -> str:
    """A parameter's text without the newline the format writes after ``<parameter=KEY>`` and before its
    close."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _xml_call(name: str, body: str, props: dict[str, Any] | None) -> ToolCall | str:
    """The call of one ``<function=name>`` block, or why it is not one. ``props``: the tool's parameters'
    schemas; None for a tool the schemas do not list (its values stay strings; the tool runner then answers
    that the tool does not exist)."""
    if not name:
        return "a <function=...> tag has no tool name: write <function=NAME>"
    if "<function=" in body:
        return f"<function={name}> is not closed with </function> before the next <function=...>"
    args: dict[str, Any] = {}
    for key, value in _PARAMETER.findall(body):
        key = key.strip()
        if "<parameter=" in value:
            return f"the parameter {key!r} of {name} is not closed with </parameter>"
        if props is None or key not in props:
            args[key] = _raw(value)
            continue
        try:
            args[key] = _typed(_raw(value), props[key])
        except ValueError as exc:
            return f"the parameter {key!r} of {name} {exc}"
    unclosed = _OPEN_PARAMETER.search(_PARAMETER.sub("", body))
    if unclosed:
        return f"the parameter {unclosed.group(1).strip()!r} of {name} is not closed with </parameter>"
    return ToolCall(name, args)


def _xml_block(body: str, schemas: dict[str, dict[str, Any]], out: Parsed) -> None:
    """The calls of one ``<tool_call>`` block's body, added to ``out``."""
    functions = _FUNCTION.findall(body)
    for name, inner in functions:
        call = _xml_call(name.strip(), inner, schemas.get(name.strip()))
        if isinstance(call, str):
            out.malformed.append(call)
        else:
            out.calls.append(call)
    if "<function=" in _FUNCTION.sub("", body):
        out.malformed.append("a <function=NAME> block is not closed with </function>")
    elif not functions:
        out.malformed.append(
            f"the <tool_call> block {body.strip()[:80]!r} holds no <function=NAME>...</function>"
        )


class Qwen3CoderParser:
    """``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`` blocks
    (Qwen3-Coder, Qwen3.5), read as vLLM's ``qwen3_coder`` tool parser reads them.

    A value is the raw text between its tags less one newline after the opening tag and one before the closing
    one; it is typed by the parameter's schema in ``tools``: ``string`` stays text, ``integer``, ``number``,
    ``object`` and ``array`` are decoded as JSON (or a Python literal), ``boolean`` is ``true``/``false`` in
    any case, and ``null`` is None whatever the type; a union (a list of types, ``anyOf``) takes its first
    type that decodes, string last. A value for a tool or parameter the schemas do not list stays a string.
    vLLM keeps a value that does not decode as a string and reads unclosed blocks, unclosed parameters and a
    bare ``<function=...>`` anyway; here each of those is a malformed call, as are a block without
    ``<function=NAME>`` and a parameter whose schema type is not JSON schema's."""

    name = "qwen3_coder"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: Schemas = None) -> Parsed:
        out, schemas = Parsed(), _properties(tools)
        for body in self._block.findall(text):
            _xml_block(body, schemas, out)
        rest = self._block.sub("", text)
        if "<tool_call>" in rest:
            out.malformed.append("a <tool_call> block is not closed with </tool_call>")
        elif "<function=" in rest:
            out.malformed.append("a <function=...> block must be inside <tool_call>...</tool_call>")
        return out


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser}


def make_parser(name: str) -> Parser:
    if name not in PARSERS:
        raise ValueError(f"agent.parser={name!r} is unknown: use one of {', '.join(PARSERS)}")
    return PARSERS[name]()
