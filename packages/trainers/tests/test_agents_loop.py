"""The agent loop: tool failures become messages and metrics, limits truncate, masks and log-probs line up.

The rollout here replays scripted model turns (ids and log-probs) and records every context it was given; the
loop, the parser, the tool runner and the environment are the real ones.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from agents_fixtures import qwen_tokenizer

from posttrain.core.env import Environment
from posttrain.core.rollout import BaseRollout, RolloutConfig, RolloutSample
from posttrain.trainers.agents.config import AgentConfig
from posttrain.trainers.rl.dataset import Prompt


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


BUSY = {"now": 0, "peak": 0}
BUSY_LOCK = threading.Lock()


def busy(seconds: float) -> str:
    """Sleep while counting the calls asleep at once.

    Args:
        seconds: How long to sleep.
    """
    with BUSY_LOCK:
        BUSY["now"] += 1
        BUSY["peak"] = max(BUSY["peak"], BUSY["now"])
    time.sleep(seconds)
    with BUSY_LOCK:
        BUSY["now"] -= 1
    return "done"


def dump(n: int) -> str:
    """Return a long text.

    Args:
        n: Characters.
    """
    return "x y " * n


class ToolsEnv(Environment):
    """calculator's tool plus a slow one and a verbose one; the first turn without calls ends with reward
    1."""

    def __init__(self) -> None:
        from posttrain.envs.calculator import calculator

        self.tools = (calculator, slow, dump, busy)


class ScriptedRollout(BaseRollout):
    """Answers episode ``i`` (in prompt order) with its next scripted text; log-prob of token j is -j/100."""

    def __init__(self, tok, scripts: list[list[str]]) -> None:
        self.tok, self.scripts, self.contexts = tok, [list(s) for s in scripts], []
        self.sampled: list[list[list[int]]] = [[] for _ in scripts]

    def generate(self, prompts, sampling):
        out = []
        live = [i for i, s in enumerate(self.scripts) if s]
        for ep, ctx in zip(live, prompts):
            self.contexts.append((ep, list(ctx)))
            ids = self.tok.encode(self.scripts[ep].pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
            ids, finish = (
                ids[: sampling.max_new_tokens],
                "stop" if len(ids) <= sampling.max_new_tokens else "length",
            )
            self.sampled[ep].append(ids)
            out.append(RolloutSample(0, list(ctx), ids, -torch.arange(len(ids)) / 100, finish))
        return out

    def update_weights(self, weights, **kwargs):
        raise NotImplementedError


def call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def run(scripts, **agent):
    tok = qwen_tokenizer()
    rollout_cfg = RolloutConfig(prompt_length=1536, response_length=256)
    loop = AgentConfig(env="calculator", tool_timeout_s=0.3, **agent).build(tok, rollout_cfg)
    loop.environments.register("tools_test", "test_agents_loop:ToolsEnv")
    rollout = ScriptedRollout(tok, scripts)
    prompts = [
        Prompt([], "synthetic_arithmetic", "5", {"env": "tools_test"}, [{"role": "user", "content": f"q{i}"}])
        for i in range(len(scripts))
    ]
    from posttrain.trainers.agents.loop import AgentLoop

    assert isinstance(loop, AgentLoop)
    start = time.perf_counter()
    episodes, _, _ = loop.run_episodes(rollout, prompts, rollout_cfg.sampling())
    run.seconds = time.perf_counter() - start
    loop.close()
    return tok, rollout, episodes


def test_every_tool_failure_is_shown_counted_and_the_run_goes_on():
    scripts = [
        ["<tool_call>{not json}</tool_call>", "#### 5"],
        [call("nope", "{}"), "#### 5"],
        [call("calculator", '{"expression": "x + 1"}'), "#### 5"],
        [call("slow", '{"seconds": 3}'), "#### 5"],
        [call("calculator", '{"expression": "2 + 3"}'), "#### 5"],
    ]
    tok, rollout, episodes = run(scripts)
    assert run.seconds < 2.5  # the slow tool was not awaited
    kinds = ["malformed", "unknown_tool", "raised", "timeout", None]
    shown = ["not valid JSON", "unknown tool 'nope'", "raised ValueError", "did not return within 0.3s", "5"]
    for e, kind, text, sampled in zip(episodes, kinds, shown, rollout.sampled):
        assert e.done and e.truncated is None and e.turns == 2
        for k in ("malformed", "unknown_tool", "raised", "timeout"):
            assert e.stats[k] == (k == kind), (kind, k)
        env_ids = [i for i, m in zip(e.traj.ids, e.traj.mask) if not m]
        assert text in tok.decode(env_ids)
        model_ids = [i for i, m in zip(e.traj.ids, e.traj.mask) if m]
        assert model_ids == sampled[0] + sampled[1]  # trained ids == sampled ids
        lp = torch.tensor(e.traj.log_probs)
        assert lp[torch.tensor(e.traj.mask) == 0].eq(0).all()
        assert lp[torch.tensor(e.traj.mask) == 1].tolist() == pytest.approx(
            [-j / 100 for s in sampled for j in range(len(s))]
        )
    for ep, ctx in rollout.contexts:  # each turn generated from the trajectory's exact ids
        assert ctx == episodes[ep].traj.context()[: len(ctx)]


def test_limits_truncate_and_mark():
    tok, _, episodes = run(
        [
            [call("dump", '{"n": 500}'), "#### 5"],
            [call("calculator", '{"expression": "1+1"}')] * 3,
            ["#### " + "5" * 250],
        ],
        max_tool_response_tokens=16,
        max_turns=2,
        max_episode_tokens=200,
    )
    long_tool, looping, too_long = episodes
    assert long_tool.stats["tool_truncated"] == 1 and long_tool.truncated is None
    assert "[truncated]" in tok.decode(long_tool.traj.ids)
    assert looping.truncated == "max_turns" and looping.turns == 2
    assert too_long.truncated == "episode_tokens" and len(too_long.traj.ids) == 200
    assert all(e.traj.mask[-1] == 1 for e in episodes)  # every trajectory ends on a sampled token


def test_bad_agent_config():
    with pytest.raises(ValueError, match="agent.parser"):
        AgentConfig(parser="xml")
    with pytest.raises(ValueError, match="no environment named 'nope'"):
        AgentConfig(env="nope").build(qwen_tokenizer(), RolloutConfig())


def test_the_async_loop_refuses_a_rollout_that_serves_no_single_requests():
    """Checked at the loop's first batch (``check_rollout``; a config that says so is refused when it loads,
    ``AgentConfig.check_rollout``): a batch-only rollout, and one whose ``agenerate`` works only in other
    settings (vLLM without the server executor says ``serves_requests = False``)."""
    tok = qwen_tokenizer()
    loop = AgentConfig(env="calculator", loop="async").build(tok, RolloutConfig())
    batched = AgentConfig(env="calculator").build(tok, RolloutConfig())
    not_now = AsyncScriptedRollout(tok, [])
    not_now.serves_requests = False
    for rollout in (ScriptedRollout(tok, []), not_now):
        with pytest.raises(ValueError, match=r"agent.loop=async needs .* does not; use .*executor=server"):
            loop.check_rollout(rollout)
        batched.check_rollout(rollout)  # the batched loop drives any rollout
    loop.check_rollout(AsyncScriptedRollout(tok, []))


class AsyncScriptedRollout(ScriptedRollout):
    """The scripted turns, one request at a time (``agenerate``), each taking ``delay`` seconds; logs
    requests."""

    def __init__(self, tok, scripts, delay: float = 0.02) -> None:
        super().__init__(tok, scripts)
        self.delay, self.log = delay, []

    async def agenerate(self, prompt_ids, sampling, prompt_index=0):
        import asyncio

        self.log.append((prompt_index, time.perf_counter(), sampling.seed))
        await asyncio.sleep(self.delay)
        ids = self.tok.encode(self.scripts[prompt_index].pop(0), add_special_tokens=False) + [
            self.tok.eos_token_id
        ]
        self.sampled[prompt_index].append(ids)
        return [RolloutSample(prompt_index, list(prompt_ids), ids, -torch.arange(len(ids)) / 100, "stop")]


def test_async_loop_has_no_barrier_between_turns():
    """A slow tool in episode 0 does not hold episode 1, which plays all its turns meanwhile."""
    tok = qwen_tokenizer()
    rollout_cfg = RolloutConfig(prompt_length=1536, response_length=512)
    loop = AgentConfig(env="calculator", loop="async", tool_timeout_s=5.0).build(tok, rollout_cfg)
    loop.environments.register("tools_test", "test_agents_loop:ToolsEnv")
    quick = call("calculator", '{"expression": "2 + 3"}')
    rollout = AsyncScriptedRollout(
        tok, [[call("slow", '{"seconds": 0.8}'), "#### 5"], [quick] * 3 + ["#### 5"]]
    )
    prompts = [
        Prompt([], "synthetic_arithmetic", "5", {"env": "tools_test"}, [{"role": "user", "content": f"q{i}"}])
        for i in range(2)
    ]
    sampling = rollout_cfg.sampling()
    sampling.seed = 3
    episodes, gen_s, tool_s = loop.run_episodes(rollout, prompts, sampling)
    loop.close()
    assert [e.turns for e in episodes] == [2, 4] and all(e.done and e.truncated is None for e in episodes)
    assert tool_s > 0.8 and gen_s > 0  # the slow tool was waited for, by episode 0 only
    second_turn_of_0 = [t for ep, t, _ in rollout.log if ep == 0][1]
    assert all(t < second_turn_of_0 for ep, t, _ in rollout.log if ep == 1)
    assert len({seed for *_, seed in rollout.log}) == len(rollout.log)  # every request its own seed
    for e, sampled in zip(episodes, rollout.sampled):
        assert [i for i, m in zip(e.traj.ids, e.traj.mask) if m] == [i for s in sampled for i in s]


@pytest.mark.parametrize("workers", [4, 24])
def test_async_loop_runs_tools_of_as_many_episodes_at_once_as_tool_workers(workers):
    """24 episodes each call a tool that sleeps 0.4 s: ``agent.tool_workers`` of them sleep at once, not the
    size of asyncio's default executor (6 threads on a 2-core machine)."""
    tok = qwen_tokenizer()
    rollout_cfg = RolloutConfig(prompt_length=1536, response_length=512)
    config = AgentConfig(env="calculator", loop="async", tool_timeout_s=30.0, tool_workers=workers)
    loop = config.build(tok, rollout_cfg)
    loop.environments.register("tools_test", "test_agents_loop:ToolsEnv")
    rollout = AsyncScriptedRollout(
        tok, [[call("busy", '{"seconds": 0.4}'), "#### 5"] for _ in range(24)], 0.0
    )
    prompts = [
        Prompt([], "synthetic_arithmetic", "5", {"env": "tools_test"}, [{"role": "user", "content": f"q{i}"}])
        for i in range(24)
    ]
    BUSY.update(now=0, peak=0)
    episodes, _, _ = loop.run_episodes(rollout, prompts, rollout_cfg.sampling())
    loop.close()
    errors = ("malformed", "unknown_tool", "raised", "timeout")
    assert all(e.done and e.turns == 2 and not any(e.stats[k] for k in errors) for e in episodes)
    assert BUSY["peak"] == workers
