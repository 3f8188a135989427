"""The calculator environment and tool, through the entry point."""

import pytest

from posttrain.core.env import ToolResult, Turn, environment_class, tool_schema
from posttrain.envs.calculator import CalculatorEnv, calculator, final_answer


def test_registered_by_entry_point():
    assert environment_class("calculator") is CalculatorEnv
    with pytest.raises(ValueError, match="calculator"):
        environment_class("nope")


def test_calculator_tool():
    assert calculator("123 * 45") == "5535"
    assert calculator("(7 - 10) * 2") == "-6"
    assert calculator("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 99999", "x + 1"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_schema_from_signature_and_docstring():
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["description"].startswith("Evaluate an arithmetic expression")
    assert schema["parameters"] == {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": 'The expression, e.g. "123 * 45".'}},
        "required": ["expression"],
    }


def test_episode_reward():
    env = CalculatorEnv(max_tool_calls=2)
    first = env.reset({"prompt": [{"role": "user", "content": "12*34?"}], "ground_truth": "408"})
    assert first == [{"role": "user", "content": "12*34?"}]
    assert not env.step(Turn("x", tool_results=[ToolResult("calculator", "408")])).done
    assert env.step(Turn("It is 408.\n#### 408")).reward == 1.0
    env.reset({"prompt": [{"role": "user", "content": "q"}], "ground_truth": "408"})
    assert env.step(Turn("#### 407")).reward == 0.0
    env.reset({"prompt": [{"role": "user", "content": "q"}], "ground_truth": "408"})
    env.step(Turn("x", tool_results=[ToolResult("calculator", "1")]))
    capped = env.step(Turn("x", tool_results=[ToolResult("calculator", "1")]))
    assert capped.done and capped.reward == 0.0
    assert final_answer("a #### 1,234.") == "1234"


def test_latency_and_jitter_delay_each_call_and_keep_the_schema():
    import time

    env = CalculatorEnv(latency_s=0.05, jitter_s=0.05, seed=3)
    (tool,) = env.tools
    assert tool_schema(tool) == tool_schema(calculator)
    waits = []
    for _ in range(3):
        start = time.perf_counter()
        assert tool("6 * 7") == "42"
        waits.append(time.perf_counter() - start)
    assert all(0.05 <= w < 0.2 for w in waits) and len({round(w, 4) for w in waits}) == 3
    assert CalculatorEnv().tools == (calculator,)
    with pytest.raises(ValueError, match="latency_s=-1"):
        CalculatorEnv(latency_s=-1)
