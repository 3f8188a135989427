"""Token-in-token-out: the trained ids are the sampled ids, and each turn's prefix is the full render so far."""

from __future__ import annotations

import json

import pytest
import torch
from agents_fixtures import llama_tokenizer, qwen_tokenizer

from posttrain.core.env import tool_schema
from posttrain.envs.calculator import calculator
from posttrain.trainers.agents.parsers import HermesParser, Llama3JsonParser
from posttrain.trainers.agents.tito import ChatRenderer, Trajectory

QWEN_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 83"}}\n</tool_call>'
LLAMA_CALL = '{"name": "calculator", "parameters": {"expression": "47 * 83"}}'
CASES = {
    "qwen2.5": (qwen_tokenizer, QWEN_CALL, HermesParser),
    "llama3": (llama_tokenizer, LLAMA_CALL, Llama3JsonParser),
}


def sample(tok, text: str) -> list[int]:
    """What a model that writes ``text`` and stops samples: its ids and the stop token."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def run_episode(tok, turns: list[str], tools: list[dict]):
    """Build a trajectory over scripted model turns with real tool results; returns (trajectory, the sampled ids
    of each turn, the conversation, the ids at the start of each model turn)."""
    renderer = ChatRenderer(tok, tools)
    messages = [{"role": "user", "content": "What is 47 * 83? Answer after ####."}]
    traj = Trajectory(renderer.initial(messages))
    sampled, starts = [], []
    for i, text in enumerate(turns):
        starts.append(traj.context())
        ids = sample(tok, text)
        sampled.append(ids)
        traj.add_model(ids, torch.linspace(-1, -0.1, len(ids)))
        messages.append({"role": "assistant", "content": text})
        if i < len(turns) - 1:
            new = [
                {"role": "tool", "name": "calculator", "content": calculator("47 * 83")},
                {"role": "tool", "name": "calculator", "content": calculator("47 + 83")},
            ]
            traj.add_env(renderer.continuation(new, ids[-1]))
            messages += new
    return traj, sampled, messages, starts


@pytest.mark.parametrize("family", sorted(CASES))
def test_trained_ids_are_sampled_ids_and_prefixes_are_full_renders(family):
    make, call, parser_cls = CASES[family]
    tok = make()
    tools = [tool_schema(calculator)]
    turns = [f"Let me compute.{call}" if family == "qwen2.5" else call, "It is 3901.\n#### 3901"]
    traj, sampled, messages, starts = run_episode(tok, turns, tools)
    mask = torch.tensor(traj.mask, dtype=torch.bool)
    ids = torch.tensor(traj.ids)
    assert ids[mask].tolist() == [i for turn in sampled for i in turn]  # trained ids == sampled ids
    assert torch.tensor(traj.log_probs)[~mask].eq(0).all() and len(traj.log_probs) == len(traj.ids)
    assert parser_cls().parse(tok.decode(sampled[0][:-1])).calls[0].arguments == {"expression": "47 * 83"}
    renderer = ChatRenderer(tok, tools)
    for k, start in enumerate(starts):  # the prefix of each model turn is the full render of the chat so far
        so_far = messages[: 1 + 3 * k] if k else messages[:1]
        assert start == renderer.encode(renderer.render(so_far, True)), f"turn {k}"
    full = renderer.encode(renderer.render(messages, False))
    assert full[: len(traj.context())] == traj.context()
    env_text = tok.decode(ids[~mask].tolist())
    assert "3901" in env_text and "130" in env_text  # both tool results, nothing of the model's
    assert tok.decode(ids[mask].tolist()).count(tok.eos_token) == 2


def test_separator_after_the_stop_token_is_kept():
    """ChatML writes a newline after <|im_end|>: it must sit between the sampled stop and the tool turn."""
    tok = qwen_tokenizer()
    traj, sampled, _, _ = run_episode(tok, [QWEN_CALL, "#### 3901"], [])
    env = traj.ids[len(sampled[0]) : len(traj.ids) - len(sampled[1])]
    assert tok.decode(env).startswith("\n<|im_start|>user\n<tool_response>\n3901")
    assert tok.decode(env).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_llama_trim_breaks_rerendering_not_the_trajectory():
    """Llama 3's template trims message content: a model turn that ends in whitespace renders differently from
    what was sampled. The trajectory keeps the sampled ids; a re-render would have trained other ids."""
    tok = llama_tokenizer()
    turns = [LLAMA_CALL + "\n ", "#### 3901"]
    traj, sampled, messages, starts = run_episode(tok, turns, [tool_schema(calculator)])
    renderer = ChatRenderer(tok, [tool_schema(calculator)])
    rerendered = renderer.encode(renderer.render(messages[:4], True))
    assert rerendered != starts[1]
    assert traj.ids[: len(sampled[0])] == sampled[0]


def test_a_template_that_rewrites_history_is_refused():
    tok = qwen_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %} (latest){% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not a suffix"):
        ChatRenderer(tok).continuation([{"role": "tool", "content": "1"}], tok.eos_token_id)


def test_parsers_malformed_calls():
    hermes = HermesParser()
    assert hermes.parse("no call").calls == [] and hermes.parse("no call").malformed == []
    two = hermes.parse(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"}</tool_call>'
    )
    assert [c.name for c in two.calls] == ["a", "b"]
    for bad in ("<tool_call>{oops}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{"):
        assert len(hermes.parse(bad).malformed) == 1 and not hermes.parse(bad).calls, bad
    as_string = json.dumps({"name": "a", "arguments": json.dumps({"x": 1})})
    assert hermes.parse(f"<tool_call>{as_string}</tool_call>").calls[0].arguments == {"x": 1}
    llama = Llama3JsonParser()
    assert llama.parse("The answer is 4").calls == []
    assert llama.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}').calls[0].arguments == {"x": 1}
    assert len(llama.parse('{"name": "a", "parameters": [1]}').malformed) == 1
