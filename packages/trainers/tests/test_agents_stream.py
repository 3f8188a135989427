"""EpisodeStream: the cap on episodes in flight, groups of the next batch starting beside this batch's
stragglers, weight pushes between requests, drain and errors.

The rollout here answers each request from the task written in the episode's prompt and logs its requests; the
pool, the agent loop, its tools and the environment are the real ones (the environment also logs when each
episode starts and ends).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from agents_fixtures import qwen_tokenizer
from test_agents_loop import ToolsEnv, call

from posttrain.core.rollout import RolloutConfig, RolloutSample
from posttrain.trainers.agents.config import AgentConfig
from posttrain.trainers.agents.stream import EpisodeStream
from posttrain.trainers.rl.dataset import Prompt

EVENTS: list[tuple[str, float, int]] = []
"""(task key, time, +1 at an episode's start / -1 at its end)."""
EVENTS_LOCK = threading.Lock()


class Watched(ToolsEnv):
    """The tools of test_agents_loop; logs the start (reset) and the end (done) of every episode."""

    def reset(self, row):
        self.key = row["prompt"][0]["content"].split()[1]
        with EVENTS_LOCK:
            EVENTS.append((self.key, time.perf_counter(), 1))
        return super().reset(row)

    def step(self, turn):
        result = super().step(turn)
        if result.done:
            with EVENTS_LOCK:
                EVENTS.append((self.key, time.perf_counter(), -1))
        return result


class TaskRollout:
    """Answers after ``delay`` s from the prompt ``TASK <key> <seconds> <calls>``: ``calls`` turns that call
    ``slow(seconds)``, then ``#### 5``; a key starting with FAIL raises. Logs (key, turn, seed, start,
    end)."""

    def __init__(self, tok, delay: float = 0.02) -> None:
        self.tok, self.delay, self.log, self.in_flight = tok, delay, [], 0

    async def agenerate(self, prompt_ids, sampling, prompt_index=0):
        start = time.perf_counter()
        self.in_flight += 1
        try:
            await asyncio.sleep(self.delay)
            task = self.tok.decode(prompt_ids).split("TASK ")[-1]
            key, seconds, calls = task.split()[:3]
            turn = task.count("<tool_call>")
            if key.startswith("FAIL"):
                raise RuntimeError(f"boom in {key}")
            text = call("slow", f'{{"seconds": {seconds}}}') if turn < int(calls) else "#### 5"
        finally:
            self.in_flight -= 1
        self.log.append((key, turn, sampling.seed, start, time.perf_counter()))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return [RolloutSample(prompt_index, list(prompt_ids), ids, -torch.arange(len(ids)) / 100, "stop")]


def agent_loop():
    tok = qwen_tokenizer()
    rollout_cfg = RolloutConfig(prompt_length=1536, response_length=512)
    loop = AgentConfig(env="calculator", loop="async", tool_timeout_s=5.0).build(tok, rollout_cfg)
    loop.environments.register("stream_test", "test_agents_stream:Watched")
    return loop, rollout_cfg


def prompts(*tasks: str) -> list[Prompt]:
    return [
        Prompt(
            [],
            "synthetic_arithmetic",
            "5",
            {"env": "stream_test"},
            [{"role": "user", "content": f"TASK {t} ."}],
        )
        for t in tasks
    ]


def sampling(rollout_cfg, n: int, seed: int):
    s = rollout_cfg.sampling()
    s.n, s.seed = n, seed
    return s


def peak_in_flight(events) -> int:
    level = peak = 0
    for _, _, delta in sorted(events, key=lambda e: e[1]):
        level += delta
        peak = max(peak, level)
    return peak


def test_cap_holds_and_the_next_batch_starts_beside_the_stragglers():
    """Cap 4, groups of 2: batch 0 fills the cap; when its quick group ends, batch 1's groups start while
    batch 0's slow group still sleeps. Batch 0's requests carry the seeds the async loop gives the same
    batch."""
    loop, rollout_cfg = agent_loop()
    rollout = TaskRollout(loop.tokenizer)
    stream = EpisodeStream(loop, rollout, max_episodes=4)
    EVENTS.clear()
    batch0 = prompts("b0p0 0.6 1", "b0p1 0.05 1")
    try:
        stream.submit(0, batch0, sampling(rollout_cfg, 2, 11), epoch=0)
        stream.submit(1, prompts("b1p0 0.05 1", "b1p1 0.05 1"), sampling(rollout_cfg, 2, 12), epoch=0)
        groups = stream.take(4)
        metrics = stream.metrics()
    finally:
        stream.close()
    assert peak_in_flight(EVENTS) == 4
    ends0 = [t for key, t, d in EVENTS if key.startswith("b0") and d < 0]
    starts1 = [t for key, t, d in EVENTS if key.startswith("b1") and d > 0]
    assert len(ends0) == 4 and len(starts1) == 4 and min(starts1) < max(ends0)
    assert [(g.batch, g.position) for g in groups][-1] == (0, 0)  # the slow group finished last
    assert all(g.turn_versions == [[0, 0], [0, 0]] and g.versions == [0, 0] for g in groups)
    assert 0 < metrics["rollout/stream/episodes_in_flight"] <= 4
    assert metrics["rollout/stream/gate_wait_s"] == 0.0
    streamed = sorted((k, t, s) for k, t, s, *_ in rollout.log if k.startswith("b0"))
    alone = TaskRollout(loop.tokenizer)
    loop.run_episodes(alone, batch0, sampling(rollout_cfg, 2, 11))  # the async loop over batch 0
    loop.close()
    assert streamed == sorted((k, t, s) for k, t, s, *_ in alone.log)
    assert len({s for _, _, s in streamed}) == len(streamed) == 8


def test_a_pause_holds_every_request_and_later_turns_take_the_new_version():
    loop, rollout_cfg = agent_loop()
    rollout = TaskRollout(loop.tokenizer, delay=0.03)
    stream = EpisodeStream(loop, rollout, max_episodes=8)
    try:
        stream.submit(0, prompts(*(f"p{i} 0.15 2" for i in range(4))), sampling(rollout_cfg, 2, 3), epoch=0)
        while len(rollout.log) < 8:  # every episode's first turn generated: they are in their tools
            time.sleep(0.005)
        with stream.paused(1):
            paused_at, idle = time.perf_counter(), rollout.in_flight
            time.sleep(0.3)  # episodes in their tools finish them; their next turns wait at the gate
            reopened_at = time.perf_counter()
        groups = stream.take(4)
        metrics = stream.metrics()
    finally:
        stream.close()
        loop.close()
    assert idle == 0
    assert not any(paused_at <= start <= reopened_at for *_, start, _ in rollout.log)
    assert not any(start < paused_at < end for *_, start, end in rollout.log)
    turns = [v for g in groups for episode in g.turn_versions for v in episode]
    assert len(turns) == len(rollout.log) == 24
    assert turns.count(0) == sum(start < paused_at for *_, start, _ in rollout.log) > 0
    assert turns.count(1) == sum(start > reopened_at for *_, start, _ in rollout.log) > 0
    for g in groups:
        assert all(v == sorted(v) for v in g.turn_versions)
        assert g.versions == [min(v) for v in g.turn_versions]
    assert any(0 in v and 1 in v for g in groups for v in g.turn_versions)  # staleness counts the oldest turn
    assert metrics["rollout/stream/gate_wait_s"] > 0


def test_drain_leaves_no_group_behind_and_none_twice():
    loop, rollout_cfg = agent_loop()
    stream = EpisodeStream(loop, TaskRollout(loop.tokenizer, delay=0.005), max_episodes=4)
    try:
        for b in range(3):
            stream.submit(
                b, prompts(f"b{b}p0 0.01 1", f"b{b}p1 0.02 0"), sampling(rollout_cfg, 2, b), epoch=0
            )
        first = stream.take(2)
        stream.drain()
        assert stream.finished == 4
        rest = stream.take(4)
        with pytest.raises(ValueError, match=r"take\(1\) with only 0 groups finished or queued"):
            stream.take(1)
    finally:
        stream.close()
        loop.close()
    keys = sorted((g.batch, g.position) for g in first + rest)
    assert keys == [(b, p) for b in range(3) for p in range(2)]


def test_an_episode_error_surfaces_in_take_and_drain():
    loop, rollout_cfg = agent_loop()
    stream = EpisodeStream(loop, TaskRollout(loop.tokenizer), max_episodes=4)
    try:
        stream.submit(0, prompts("ok 0.01 1", "FAIL 0.01 1"), sampling(rollout_cfg, 2, 0), epoch=0)
        with pytest.raises(RuntimeError, match="boom in FAIL"):
            stream.take(2)
        with pytest.raises(RuntimeError, match="boom in FAIL"):
            stream.drain()
    finally:
        stream.close()
        loop.close()


def test_stream_refusals():
    from test_agents_loop import ScriptedRollout

    loop, rollout_cfg = agent_loop()
    try:
        with pytest.raises(ValueError, match="needs a rollout that generates one request at a time"):
            EpisodeStream(loop, ScriptedRollout(loop.tokenizer, []), max_episodes=4)
        stream = EpisodeStream(loop, TaskRollout(loop.tokenizer), max_episodes=4)
        with pytest.raises(ValueError, match="raise trainer.stream_episodes to at least 8"):
            stream.submit(0, prompts("a 0 0"), sampling(rollout_cfg, 8, 0), epoch=0)
        stream.close()
    finally:
        loop.close()
