"""Tool-call parsers: calls read with their arguments' types, and every unreadable call reported, not raised.

The ``qwen3_coder`` tests use real tool schemas (:func:`posttrain.core.env.tool_schema`), Qwen3-Coder's chat
template and the real tool runner and agent loop.
"""

from __future__ import annotations

import json

import pytest
from agents_fixtures import qwen3_coder_tokenizer
from test_agents_loop import ScriptedRollout

from posttrain.core.env import Environment, StepResult, Turn, tool_schema
from posttrain.core.rollout import RolloutConfig
from posttrain.envs.calculator import calculator
from posttrain.trainers.agents.config import AgentConfig
from posttrain.trainers.agents.parsers import HermesParser, Llama3JsonParser, Qwen3CoderParser, make_parser
from posttrain.trainers.agents.tito import ChatRenderer
from posttrain.trainers.agents.tools import ToolRunner
from posttrain.trainers.rl.dataset import Prompt


def plan(
    city: str,
    days: int,
    budget: float,
    metric: bool,
    filters: dict,
    stops: list[str],
    note: str = "",
    limit: int | None = None,
    size: int | str = "m",
) -> str:
    """Plan a trip.

    Args:
        city: Where to.
        days: How many days.
    """
    values = (city, days, budget, metric, filters, stops, note, limit, size)
    return " ".join(f"{type(v).__name__}:{v!r}" for v in values)


TOOLS = [tool_schema(plan), tool_schema(calculator)]
ODD = {"date": {"type": "date"}, "n": {"type": ["integer", "boolean"]}}
"""Parameter schemas no Python signature gives: a type JSON schema lacks, a list of types."""


def xml(name: str, **params: str) -> str:
    """One call in Qwen3-Coder's format, each value written as the template writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


GOOD = dict(
    city="Paris", days="3", budget="2.5", metric="false", filters='{"kind": "museum"}', stops='["a", "b"]'
)


def test_hermes_and_llama3_read_json_calls_and_ignore_the_schemas():
    hermes = HermesParser()
    assert hermes.parse("no call").calls == [] and hermes.parse("no call").malformed == []
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"}</tool_call>'
    assert [c.name for c in hermes.parse(two).calls] == ["a", "b"]
    for bad in ("<tool_call>{oops}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{"):
        assert len(hermes.parse(bad).malformed) == 1 and not hermes.parse(bad).calls, bad
    as_string = json.dumps({"name": "a", "arguments": json.dumps({"x": 1})})
    assert hermes.parse(f"<tool_call>{as_string}</tool_call>").calls[0].arguments == {"x": 1}
    typed = '<tool_call>{"name": "plan", "arguments": {"days": "3"}}</tool_call>'
    assert hermes.parse(typed, TOOLS).calls[0].arguments == {"days": "3"}  # the JSON's own types, as before
    llama = Llama3JsonParser()
    assert llama.parse("The answer is 4").calls == []
    assert llama.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}').calls[0].arguments == {"x": 1}
    assert len(llama.parse('{"name": "a", "parameters": [1]}').malformed) == 1
    with pytest.raises(
        ValueError, match="agent.parser='xml' is unknown: use one of hermes, llama3_json, qwen3_coder"
    ):
        make_parser("xml")


def test_qwen3_coder_types_each_value_by_its_schema():
    note = (
        "  first line\n\nsecond line\n"  # inner and edge newlines are the value's; one more each side is not
    )
    text = xml("plan", **GOOD, note=note, limit="null", size="7")
    parsed = make_parser("qwen3_coder").parse(text, TOOLS)
    assert parsed.malformed == []
    (call,) = parsed.calls
    assert call.name == "plan"
    assert call.arguments == {
        "city": "Paris",
        "days": 3,
        "budget": 2.5,
        "metric": False,
        "filters": {"kind": "museum"},
        "stops": ["a", "b"],
        "note": note,
        "limit": None,
        "size": 7,
    }
    assert [type(call.arguments[k]) for k in ("days", "budget", "metric")] == [int, float, bool]
    loose = xml(
        "plan", **{**GOOD, "days": "12", "budget": "4", "metric": "True", "filters": "{'kind': 'park'}"}
    )
    (call,) = Qwen3CoderParser().parse(loose, TOOLS).calls  # Python literals, as older templates wrote them
    assert (call.arguments["days"], call.arguments["budget"], call.arguments["metric"]) == (12, 4, True)
    assert call.arguments["filters"] == {"kind": "park"}
    assert Qwen3CoderParser().parse(xml("plan", **GOOD, size="xl"), TOOLS).calls[0].arguments["size"] == "xl"


def test_qwen3_coder_reads_several_calls_and_leaves_plain_text_alone():
    parser = Qwen3CoderParser()
    assert (
        parser.parse("It is 3901.", TOOLS).calls == [] and parser.parse("It is 3901.", TOOLS).malformed == []
    )
    text = (
        f"Two things first.\n{xml('calculator', expression='47 * 83')}\n{xml('plan', **GOOD)}"
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n1 + 1\n</parameter>\n</function>\n"
        "<function=calculator>\n<parameter=expression>\n2 + 2\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = parser.parse(text, TOOLS)
    assert parsed.malformed == []
    assert [c.name for c in parsed.calls] == ["calculator", "plan", "calculator", "calculator"]
    assert [c.arguments.get("expression") for c in parsed.calls] == ["47 * 83", None, "1 + 1", "2 + 2"]
    assert parser.parse("<tool_call>\n<function=now>\n</function>\n</tool_call>").calls[0].arguments == {}


MALFORMED = {
    "no function": ('<tool_call>\n{"name": "plan"}\n</tool_call>', "holds no <function=NAME>"),
    "unclosed block": (
        xml("calculator", expression="1 + 1").removesuffix("</tool_call>"),
        "not closed with </tool_call>",
    ),
    "unclosed function": (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</tool_call>",
        "not closed with </function>",
    ),
    "no name": ("<tool_call>\n<function=>\n</function>\n</tool_call>", "has no tool name"),
    "outside a block": (
        "<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</function>",
        "must be inside <tool_call>",
    ),
    "parameter not closed before the next": (
        xml("plan", **GOOD).replace("Paris\n</parameter>", "Paris\n"),
        "parameter 'city' of plan is not closed with </parameter>",
    ),
    "last parameter not closed": (
        xml("plan", **GOOD).replace('["a", "b"]\n</parameter>', '["a", "b"]'),
        "parameter 'stops' of plan is not closed with </parameter>",
    ),
    "not an integer": (
        xml("plan", **{**GOOD, "days": "three"}),
        "parameter 'days' of plan is 'three', which is not an integer",
    ),
    "a boolean is not an integer": (
        xml("plan", **{**GOOD, "days": "true"}),
        "'true', which is not an integer",
    ),
    "not a number": (xml("plan", **{**GOOD, "budget": "cheap"}), "'cheap', which is not a number"),
    "not a boolean": (xml("plan", **{**GOOD, "metric": "yes"}), "'yes', which is not a boolean"),
    "not an object": (xml("plan", **{**GOOD, "filters": "[1]"}), "'[1]', which is not a JSON object"),
    "not an array": (xml("plan", **{**GOOD, "stops": "a, b"}), "'a, b', which is not a JSON array"),
    "not in the union": (
        xml("odd", n="many"),
        "'many', which is not an integer or a boolean (true or false)",
    ),
    "unknown type": (
        xml("odd", date="2025-01-01"),
        "parameter 'date' of odd has the schema type 'date', which the qwen3_coder parser cannot decode",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_qwen3_coder_malformed_calls_are_reported_and_the_good_ones_kept(case):
    text, message = MALFORMED[case]
    tools = [*TOOLS, {"type": "function", "function": {"name": "odd", "parameters": {"properties": ODD}}}]
    parser = Qwen3CoderParser()
    parsed = parser.parse(text, tools)
    assert parsed.calls == [] and len(parsed.malformed) == 1, parsed
    assert message in parsed.malformed[0]
    both = parser.parse(f"{xml('calculator', expression='2 + 3')}\n{text}", tools)
    assert [c.arguments for c in both.calls] == [
        {"expression": "2 + 3"}
    ] and both.malformed == parsed.malformed


def test_qwen3_coder_unknown_tools_and_parameters_stay_strings_and_the_runner_answers():
    text = xml("nope", x="3") + xml("calculator", expression="2 + 3", precision="2") + xml("plan", days="3")
    parsed = Qwen3CoderParser().parse(text, TOOLS)
    assert [c.arguments for c in parsed.calls] == [
        {"x": "3"},
        {"expression": "2 + 3", "precision": "2"},
        {"days": 3},
    ]
    assert Qwen3CoderParser().parse(xml("plan", days="3")).calls[0].arguments == {
        "days": "3"
    }  # no schemas: text
    runner = ToolRunner(qwen3_coder_tokenizer(), timeout_s=5.0, max_tokens=64, workers=2)
    try:
        (results,) = runner.run([(parsed.calls, {"calculator": calculator, "plan": plan})])
    finally:
        runner.close()
    assert [r.error for r in results] == ["unknown_tool", "raised", "raised"]
    assert results[0].content == "error: unknown tool 'nope' (tools: calculator, plan)"
    assert "unexpected keyword argument 'precision'" in results[1].content
    assert "missing 5 required positional arguments" in results[2].content


def test_qwen3_coder_reads_back_the_calls_its_template_writes():
    """The template renders an assistant message's structured ``tool_calls`` (values through ``tojson`` or
    ``string``); the parser gives back the same arguments. The text differs from what a model writing JSON
    booleans samples (``False``, not ``false``): a history rendered from structured calls is not the sampled
    one."""
    tok = qwen3_coder_tokenizer()
    args = {"city": "Paris", "days": 3, "budget": 2.5, "metric": False, "filters": {"kind": "museum"}}
    args |= {"stops": ["a", "b"], "note": "two\nlines"}
    calls = [{"type": "function", "function": {"name": "plan", "arguments": args}}]
    chat = [
        {"role": "user", "content": "Plan it."},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    full = ChatRenderer(tok, TOOLS).render(chat, False)
    assistant = full[
        full.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") : -len("<|im_end|>\n")
    ]
    assert assistant.startswith("<tool_call>\n<function=plan>\n<parameter=city>\nParis\n</parameter>\n")
    assert "<parameter=metric>\nFalse\n</parameter>" in assistant
    assert Qwen3CoderParser().parse(assistant, TOOLS).calls[0].arguments == args


class PlanEnv(Environment):
    """``plan`` and ``calculator``; the first turn without calls ends the episode."""

    tools = (plan, calculator)

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=not turn.tool_calls and not turn.tool_results)


def test_the_loop_types_values_by_the_environments_schemas():
    """Without the schemas ``days`` would reach ``plan`` as the string "3"."""
    tok = qwen3_coder_tokenizer()
    rollout_cfg = RolloutConfig(prompt_length=3072, response_length=2048)
    loop = AgentConfig(env="calculator", parser="qwen3_coder").build(tok, rollout_cfg)
    loop.environments.register("plan_test", "test_agents_parsers:PlanEnv")
    scripts = [[xml("plan", **GOOD) + xml("plan", **{**GOOD, "days": "three"}), "#### 5"]]
    rollout = ScriptedRollout(tok, scripts)
    prompts = [
        Prompt([], "synthetic_arithmetic", "5", {"env": "plan_test"}, [{"role": "user", "content": "q"}])
    ]
    try:
        (episode,), _, _ = loop.run_episodes(rollout, prompts, rollout_cfg.sampling())
    finally:
        loop.close()
    assert episode.done and episode.turns == 2
    assert episode.stats["tool_calls"] == 2 and episode.stats["malformed"] == 1
    shown = tok.decode([i for i, m in zip(episode.traj.ids, episode.traj.mask) if not m])
    assert "str:'Paris' int:3 float:2.5 bool:False dict:{'kind': 'museum'} list:['a', 'b']" in shown
    assert "error: the parameter 'days' of plan is 'three', which is not an integer" in shown
