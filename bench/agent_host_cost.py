"""Host CPU cost of one agent turn, per phase: the work the agent loop does in the rollout's process between
two generations, with no model and no vLLM.

The agent loop runs in the same Python process as vLLM's ``AsyncLLM`` front end (``agent.loop=async``), so
every millisecond it holds the GIL is one vLLM's output handler waits for. This bench times that work alone:
the tokenizer of ``posttrain model init --size tiny`` (``--vocab 151936``: padded to Qwen2.5's vocabulary, as
the ``0.5b`` size has it), given bench/agent_throughput.py's template (``add_tool_call_rendering``;
``--template qwen2.5`` takes the Qwen2.5 template of the agent tests instead, which renders the tools' schemas
in a system message), the ``calculator`` environment (posttrain-envs) with no tool latency, and the episode an
SFT'd model plays in bench/agent_throughput.py: "What is 47 * 83 + 12 * 34?", three Hermes ``<tool_call>``
turns (both products, their sum) and the answer turn. A sampled turn is the ids of that text plus the stop
token, with float32 log-probs (a ``RolloutSample`` as the vLLM rollout returns it).

Per repetition, one fresh episode (``AgentLoop.start``) and its turns through the loop's own methods:

- ``take``: ``AgentLoop._take`` (append the ids and log-probs, decode, parse the tool calls);
- ``tools``: ``ToolRunner.run`` of the turn's call (the pool hop and the calculator, no sleep);
- ``step``: ``env.step``;
- ``answer``: ``AgentLoop._answer`` (cap each tool result's length, ``ChatRenderer.continuation``: render the
  tool message and tokenize it, append); ``render`` alone: ``continuation`` of the same message;
- ``turn``: the whole turn as the async loop runs it (``_take`` then ``_tools_and_step``), inline;
- ``play``: ``AgentLoop.play`` of ``--in-flight`` whole episodes at once on an asyncio loop whose ``generate``
  answers at once (so the hops to the step pool and the tool pool are in, and ``start``), per turn.

Reported per phase: the median over repetitions of the CPU microseconds of the process (``time.process_time``:
every thread, so the tool pool's too) and of the wall microseconds (``perf_counter``), for tool turns and the
answer turn; ``start`` is per episode. ``turns_per_cpu_s`` = 1e6 / the median CPU microseconds of a tool turn
(``turn`` and ``play``): how many such turns one core does with nothing else to do. JSON to stdout (and
``--out``); the machine is shared, so compare runs made together (interleave them).

    uv run python bench/agent_host_cost.py --repeats 300
    uv run python bench/agent_host_cost.py --repeats 300 --vocab 151936 --template qwen2.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_agent  # noqa: E402  (add_tool_call_rendering)

ROOT = Path(__file__).resolve().parents[1]
QWEN_TEMPLATE = ROOT / "packages/trainers/tests/agents_templates/qwen2_5.jinja"
QUESTION, TRUTH = "What is 47 * 83 + 12 * 34?", "4309"
CALLS = ("47 * 83", "12 * 34", "3901 + 408")
ANSWER = "47 * 83 = 3901 and 12 * 34 = 408, so the sum is 4309.\n#### 4309"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=300, help="episodes timed (after --warmup untimed ones)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--vocab", type=int, default=None, help="pad the tiny tokenizer to this many tokens")
    p.add_argument("--in-flight", type=int, default=16, help="episodes played at once in the play phase")
    p.add_argument("--template", choices=("model", "qwen2.5"), default="model")
    p.add_argument("--out", default=None, help="JSON file")
    return p.parse_args(argv)


def make_tokenizer(vocab: int | None, template: str, workdir: Path) -> Any:
    """The tiny model's tokenizer, with bench/agent_throughput.py's template or the Qwen2.5 one."""
    from transformers import AutoTokenizer

    from posttrain.trainers.model_init import init_model

    model_dir = str(init_model(workdir / "model", size="tiny", seed=0, vocab_size=vocab))
    trl_agent.add_tool_call_rendering(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if template == "qwen2.5":
        tok.chat_template = QWEN_TEMPLATE.read_text()
    return tok


def make_loop(tok: Any) -> Any:
    from posttrain.core.rollout import RolloutConfig
    from posttrain.trainers.agents.config import AgentConfig

    config = AgentConfig(env="calculator", env_kwargs={}, loop="async", max_turns=len(CALLS) + 1)
    return config.build(tok, RolloutConfig(prompt_length=2048, response_length=1024))


def scripted_samples(tok: Any) -> list[Any]:
    """The sampled turns of one episode: a ``RolloutSample`` per turn (ids + stop token, float32
    log-probs)."""
    from posttrain.core.rollout import RolloutSample
    from posttrain.trainers.data.synthetic import calculator_call

    out = []
    for text in [*(calculator_call(c) for c in CALLS), ANSWER]:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        lps = -torch.rand(len(ids), generator=torch.Generator().manual_seed(len(out)))
        out.append(RolloutSample(0, [], ids, lps.float(), "stop"))
    return out


def prompt() -> Any:
    from posttrain.trainers.data.synthetic import CALCULATOR_INSTRUCTION
    from posttrain.trainers.rl.dataset import Prompt

    messages = [{"role": "user", "content": f"{QUESTION} {CALCULATOR_INSTRUCTION}"}]
    return Prompt([], "calculator", TRUTH, {}, messages)


class Clock:
    """Laps of CPU and wall nanoseconds, kept per phase."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[int]] = defaultdict(list)
        self.wall: dict[str, list[int]] = defaultdict(list)
        self.mark()

    def mark(self) -> None:
        self.c, self.w = time.process_time_ns(), time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        c, w = time.process_time_ns(), time.perf_counter_ns()
        self.cpu[phase].append(c - self.c)
        self.wall[phase].append(w - self.w)
        self.c, self.w = c, w


def phases_episode(loop: Any, samples: list[Any], clock: Clock) -> None:
    """One episode through ``_take``, ``ToolRunner.run``, ``env.step`` and ``_answer``, each timed; then
    ``continuation`` of the same messages alone."""
    clock.mark()
    e = loop.start(0, prompt())
    clock.lap("start")
    for k, sample in enumerate(samples):
        kind = "tool" if k < len(CALLS) else "answer"
        clock.mark()
        turn = loop._take(e, sample)
        clock.lap(f"{kind}/take")
        results = loop.runner.run([(turn.tool_calls, e.tools)])[0] if turn.tool_calls else []
        clock.lap(f"{kind}/tools")
        turn.tool_results += results
        result = e.env.step(turn)
        clock.lap(f"{kind}/step")
        loop._answer(e, turn, result, False)
        clock.lap(f"{kind}/answer")
        if kind == "tool":
            messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
            e.renderer.continuation(messages, sample.response_ids[-1])
            clock.lap("tool/render")
    if not (e.done and e.reward == 1.0 and e.turns == len(samples)):
        raise RuntimeError(f"the scripted episode did not end right: {e}")


def turns_episode(loop: Any, samples: list[Any], clock: Clock) -> None:
    """One episode with each whole turn timed as the async loop runs it (``_take``, ``_tools_and_step``)."""
    e = loop.start(0, prompt())
    for k, sample in enumerate(samples):
        kind = "tool" if k < len(CALLS) else "answer"
        clock.mark()
        turn = loop._take(e, sample)
        loop._tools_and_step(e, turn, k)
        clock.lap(f"{kind}/turn")


async def play_episodes(loop: Any, samples: list[Any], clock: Clock, count: int, at_once: int) -> None:
    """``count`` rounds of ``at_once`` episodes played together through ``AgentLoop.play``, with a
    ``generate`` that answers at once with the episode's next scripted turn; a round's lap is per turn (its
    time over its turns)."""
    from posttrain.core.rollout import SamplingConfig

    sampling = SamplingConfig(seed=1)

    async def one(k: int) -> None:
        e, turns = loop.start(0, prompt()), iter(samples)

        async def generate(context, call, index):
            return [next(turns)]

        await loop.play(k, e, generate, sampling)

    for _ in range(count):
        clock.mark()
        await asyncio.gather(*(one(k) for k in range(at_once)))
        clock.lap("play")
        clock.cpu["play"][-1] //= at_once * len(samples)
        clock.wall["play"][-1] //= at_once * len(samples)


def summary(clock: Clock, skip: int) -> dict[str, dict[str, float]]:
    """Median microseconds per phase (CPU and wall), the first ``skip`` laps of each dropped."""
    out = {}
    for phase in sorted(clock.cpu):
        cpu, wall = clock.cpu[phase][skip:], clock.wall[phase][skip:]
        out[phase] = {
            "cpu_us": round(statistics.median(cpu) / 1e3, 1),
            "wall_us": round(statistics.median(wall) / 1e3, 1),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agent-host-") as tmp:
        tok = make_tokenizer(args.vocab, args.template, Path(tmp))
    loop, samples = make_loop(tok), scripted_samples(tok)
    clock = Clock()
    total = args.warmup + args.repeats
    try:
        for _ in range(total):
            phases_episode(loop, samples, clock)
            turns_episode(loop, samples, clock)
        asyncio.run(play_episodes(loop, samples, clock, total, args.in_flight))
    finally:
        loop.close()
    skip_turns = args.warmup * len(CALLS)
    phases = {k: v for k, v in summary(clock, skip_turns).items() if k.startswith("tool/")}
    phases |= {k: v for k, v in summary(clock, args.warmup).items() if not k.startswith("tool/")}
    report = {
        "config": vars(args),
        "sampled_ids_per_turn": [len(s.response_ids) for s in samples],
        "phases": phases,
        "turns_per_cpu_s": {
            k: round(1e6 / phases[k]["cpu_us"]) for k in ("tool/turn", "play") if phases[k]["cpu_us"] > 0
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return report


if __name__ == "__main__":
    main()
