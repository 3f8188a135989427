"""Token-in-token-out: the trained ids are the sampled ids, and each turn's prefix is the full render so
far."""

from __future__ import annotations

import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from agents_fixtures import llama_tokenizer, qwen3_coder_tokenizer, qwen_tokenizer

from posttrain.core.env import tool_schema
from posttrain.envs.calculator import calculator
from posttrain.trainers.agents import tito
from posttrain.trainers.agents.codec import Codec, plain
from posttrain.trainers.agents.parsers import HermesParser, Llama3JsonParser, Qwen3CoderParser
from posttrain.trainers.agents.tito import _CONTEXT, ChatRenderer, Trajectory

QWEN_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 83"}}\n</tool_call>'
LLAMA_CALL = '{"name": "calculator", "parameters": {"expression": "47 * 83"}}'
QWEN3_CODER_CALL = (
    "<tool_call>\n<function=calculator>\n<parameter=expression>\n47 * 83\n</parameter>\n</function>\n"
    "</tool_call>"
)
CASES = {
    "qwen2.5": (qwen_tokenizer, QWEN_CALL, HermesParser),
    "llama3": (llama_tokenizer, LLAMA_CALL, Llama3JsonParser),
    "qwen3-coder": (qwen3_coder_tokenizer, QWEN3_CODER_CALL, Qwen3CoderParser),
}


def sample(tok, text: str) -> list[int]:
    """What a model that writes ``text`` and stops samples: its ids and the stop token."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def run_episode(tok, turns: list[str], tools: list[dict]):
    """Build a trajectory over scripted model turns with real tool results; returns (trajectory, the sampled
    ids of each turn, the conversation, the ids at the start of each model turn)."""
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
    turns = [call if family == "llama3" else f"Let me compute.{call}", "It is 3901.\n#### 3901"]
    traj, sampled, messages, starts = run_episode(tok, turns, tools)
    mask = torch.tensor(traj.mask, dtype=torch.bool)
    ids = torch.tensor(traj.ids)
    assert ids[mask].tolist() == [i for turn in sampled for i in turn]  # trained ids == sampled ids
    assert torch.tensor(traj.log_probs)[~mask].eq(0).all() and len(traj.log_probs) == len(traj.ids)
    (parsed,) = parser_cls().parse(tok.decode(sampled[0][:-1]), tools).calls
    assert parsed.arguments == {"expression": "47 * 83"}
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
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if loop.last %} (latest){% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not a suffix"):
        ChatRenderer(tok).continuation([{"role": "tool", "content": "1"}], tok.eos_token_id)


TEXTS = [
    "",
    "3901",
    "  \n\t x",
    QWEN_CALL,
    LLAMA_CALL,
    QWEN3_CODER_CALL,
    "error: calculator raised ValueError: unsupported expression element Name(id='x')",
    "ünïcødé 数学 🙂 ...[truncated]",
    "\n<|im_start|>user\n<tool_response>\n130\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "<|start_header_id|>ipython<|end_header_id|>\n\n3901<|eot_id|>",
]


@pytest.mark.parametrize("family", sorted(CASES))
def test_codec_gives_the_tokenizers_ids_and_text(family):
    """The backend call the loop makes is the tokenizer's own: same ids, same text; when the backend's state
    differs from what the tokenizer's call would set (truncation, split special tokens), the tokenizer is
    called."""
    tok = CASES[family][0]()
    codec = Codec(tok)
    assert codec.direct() and codec.direct_decode
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert codec.encode(text) == ids, text
        assert codec.decode(ids) == tok.decode(ids), text
        assert codec.decode(ids[:-1]) == tok.decode(ids[:-1]), text
    special = tok.eos_token + " 1"
    whole = tok.encode(special, add_special_tokens=False)
    tok.backend_tokenizer.enable_truncation(2)  # left by a caller of tok(..., truncation=True)
    assert not codec.direct() and codec.encode(TEXTS[6]) == tok.encode(TEXTS[6], add_special_tokens=False)
    tok.split_special_tokens = True
    split = tok.encode(special, add_special_tokens=False)
    assert split != whole and codec.encode(special) == split
    tok.split_special_tokens = False  # the backend still splits: the codec calls the tokenizer
    assert not codec.direct() and codec.encode(special) == whole

    class Custom(type(tok)):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    assert not plain(Custom(tokenizer_object=tok.backend_tokenizer)) and plain(tok)


@pytest.mark.parametrize("family", sorted(CASES))
def test_kept_context_render_gives_the_full_renders_ids(family):
    """The continuation renders [user, assistant] once and keeps it: its ids equal those of rendering both
    every time, turn after turn, and after the kept render goes stale (a template that renders the date)."""
    tok = CASES[family][0]()
    tools = [tool_schema(calculator)]
    renderer, reference = ChatRenderer(tok, tools), ChatRenderer(tok, tools)

    def full_render(new):
        base = reference.render(_CONTEXT, False)
        text = reference.separator(tok.eos_token_id) + reference.render([*_CONTEXT, *new], True)[len(base) :]
        return tok.encode(text, add_special_tokens=False)

    turns = [
        [{"role": "tool", "name": "calculator", "content": "3901"}],
        [{"role": "tool", "name": "calculator", "content": c} for c in ("408", "error: x")],
        [{"role": "tool", "name": "calculator", "content": "4309"}, {"role": "user", "content": "Go on."}],
    ]
    for new in turns:
        assert renderer.continuation(new, tok.eos_token_id) == full_render(new)
    renderer._base = renderer.base().replace("system", "sys")
    assert renderer.continuation(turns[0], tok.eos_token_id) == full_render(turns[0])
    traj = Trajectory([])
    traj.add_model([5, 6], torch.tensor([-0.1, -2.7]))
    assert traj.log_probs == [float(x) for x in torch.tensor([-0.1, -2.7])] and traj.ids == [5, 6]


@pytest.mark.parametrize("family", sorted(CASES))
def test_kept_first_observation_ids_are_the_full_renders(family, monkeypatch):
    """A renderer keeps the ids of the first observations it rendered (shared by a GRPO group's episodes):
    each call gives the full render's ids, a caller changing its list changes no other's, and all are dropped
    when more than KEPT come."""
    tok = CASES[family][0]()
    renderer = ChatRenderer(tok, [tool_schema(calculator)])
    chats = [
        [{"role": "user", "content": q}] for q in ("What is 47 * 83?", "What is 12 * 34?", "What is 47 * 83?")
    ]
    for chat in chats * 2:
        ids = renderer.initial(chat)
        assert ids == tok.encode(renderer.render(chat, True), add_special_tokens=False)
        ids.append(-1)
    assert len(renderer._initial) == 2
    monkeypatch.setattr(tito, "KEPT", 2)
    other = [{"role": "user", "content": "What is 1 * 2?"}]
    assert renderer.initial(other) == tok.encode(renderer.render(other, True), add_special_tokens=False)
    assert len(renderer._initial) == 1


@pytest.mark.parametrize("family", sorted(CASES))
def test_shared_renderer_from_many_threads_gives_fresh_renders_ids(family, monkeypatch):
    """One renderer serves every episode with the same tools, on the step pool's threads and the stream's:
    eight threads calling it at once, while its kept first observations are dropped over and over and its kept
    [user, assistant] render goes stale, get the ids a fresh renderer gives for each call."""
    tok = CASES[family][0]()
    tools = [tool_schema(calculator)]
    chats = [[{"role": "user", "content": f"What is {a} * {b}?"}] for a in range(3, 9) for b in (7, 83)]
    turns = [
        [{"role": "tool", "name": "calculator", "content": calculator(f"{a} * 83")}, *extra]
        for a in range(4)
        for extra in ([], [{"role": "user", "content": "Go on."}])
    ]
    fresh = ChatRenderer(tok, tools)
    want_initial = [fresh.encode(fresh.render(c, True)) for c in chats]
    want_next = [ChatRenderer(tok, tools).continuation(t, tok.eos_token_id) for t in turns]
    monkeypatch.setattr(tito, "KEPT", 3)
    shared, start = ChatRenderer(tok, tools), threading.Barrier(8)

    def hammer(seed: int) -> int:
        rng, wrong = random.Random(seed), 0
        start.wait()
        for _ in range(150):
            if rng.random() < 0.1:
                shared._base = "a render from yesterday"
            i, j = rng.randrange(len(chats)), rng.randrange(len(turns))
            ids = shared.initial(chats[i])
            wrong += ids != want_initial[i]
            ids.append(-1)  # the caller owns its list
            wrong += shared.continuation(turns[j], tok.eos_token_id) != want_next[j]
        return wrong

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(hammer, range(8))) == 0
    finally:
        sys.setswitchinterval(interval)
