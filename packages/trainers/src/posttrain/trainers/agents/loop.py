"""The agent loop over a rollout that generates from token ids: many episodes, their turns batched.

Each prompt starts ``sampling.n`` episodes (its GRPO group), each with its own environment (``reset(row)``). A
turn: one ``rollout.generate`` call over the context ids of every live episode (the trajectory's exact ids,
:mod:`.tito`), one sample each; the sampled ids and log-probs are appended as they are; the decoded text is
parsed for tool calls (:mod:`.parsers`), every live episode's calls run at once on the tool pool
(:mod:`.tools`), and ``env.step`` answers. Its tool results and observation are rendered incrementally and
appended with mask 0.
With ``agent.loop=batched`` there is a barrier at every turn (one batched generate over the live episodes; any
rollout). With ``agent.loop=async`` every episode advances on its own: it awaits ``rollout.agenerate`` for its
turn (the vLLM rollout with ``rollout.executor=server``: vLLM's ``AsyncLLM`` batches whatever requests are in
flight; the HF rollout decodes them one at a time), runs its tools and ``env.step`` on a worker thread, and
asks for its next turn at once, so a slow episode or tool holds back no other. Each request then samples with
its own seed (the step's seed mixed with the episode and the turn). ``trainer.mode=stream`` plays the same
episodes (:meth:`AgentLoop.play`) in a pool that runs across batches (:mod:`.stream`).

An episode ends when the environment says done, or is *truncated*: its turn hit ``rollout`` length limits or
``agent.max_episode_tokens``, the environment's answer would not fit, or it still calls tools after
``agent.max_turns`` turns. A trajectory always ends on the model's last sampled token (an answer that would
not fit is not appended), so the score sits on a trained token. The score is the environment's reward when it
gave one, else the trainer's reward function over the decoded trajectory; a truncated episode scores
``agent.truncated_reward`` when set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from posttrain.core.env import Environment, EnvironmentRegistry, StepResult, ToolResult, Turn
from posttrain.core.rollout import BaseRollout, RolloutSample, SamplingConfig, serves_requests

from .codec import Codec
from .config import AgentConfig
from .parsers import make_parser
from .tito import KEPT, ChatRenderer, Trajectory
from .tools import ERROR_KINDS, ToolRunner

Generate = Callable[[list[int], SamplingConfig, int], Awaitable[list[RolloutSample]]]
"""``(context ids, sampling, prompt index) -> [sample]``: one request of one episode's turn
(``rollout.agenerate``)."""


@dataclasses.dataclass
class Episode:
    """One live or finished episode."""

    index: int
    """Its prompt's index in the call (its GRPO group)."""
    prompt: Any
    env: Environment | None
    """None once :meth:`detached`, as are ``tools`` (empty) and ``renderer``."""
    tools: dict[str, Callable[..., Any]]
    renderer: ChatRenderer | None
    traj: Trajectory
    done: bool = False
    truncated: str | None = None
    """Why it was cut (``length``, ``episode_tokens``, ``max_turns``), None when it ended normally."""
    reward: float | None = None
    turns: int = 0
    stats: Counter = dataclasses.field(default_factory=Counter)

    def truncate(self, why: str) -> None:
        self.done, self.truncated = True, why

    def detached(self) -> Episode:
        """This episode without its environment, tools and renderer: what a finished episode carries out of a
        rollout process (:mod:`posttrain.trainers.rl.remote`); scoring and the batch read nothing else."""
        return dataclasses.replace(self, env=None, tools={}, renderer=None)


class AgentLoop:
    """Runs episodes of the configured environment over a rollout; see the module docstring."""

    def __init__(self, config: AgentConfig, tokenizer: Any, rollout_config: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.codec = Codec(tokenizer)
        self.parser = make_parser(config.parser)
        self.context_limit = rollout_config.max_model_len or (
            rollout_config.prompt_length + rollout_config.response_length
        )
        self.prompt_limit = rollout_config.prompt_length
        self.turn_tokens = config.max_tokens_per_turn or rollout_config.response_length
        self.episode_tokens = config.max_episode_tokens or rollout_config.response_length
        if self.prompt_limit + self.episode_tokens > self.context_limit:
            raise ValueError(
                f"agent.max_episode_tokens={self.episode_tokens} + rollout.prompt_length={self.prompt_limit} "
                f"exceed the rollout's context of {self.context_limit} tokens: lower it or raise "
                "rollout.max_model_len"
            )
        self.runner = ToolRunner(
            tokenizer,
            timeout_s=config.tool_timeout_s,
            max_tokens=config.max_tool_response_tokens,
            workers=config.tool_workers,
        )
        self.step_pool = ThreadPoolExecutor(
            max_workers=config.tool_workers, thread_name_prefix="posttrain-step"
        )
        """Where the async loop runs an episode's tools and ``env.step`` (asyncio's default executor would cap
        the episodes in their tools at once at its own size, 6 to 32 threads, whatever ``agent.tool_workers``
        says)."""
        self.environments = EnvironmentRegistry.from_entry_points()
        """Where ``agent.env`` and a row's ``extra_info.env`` are looked up (installed entry points)."""
        self.environments.get_environment_cls(config.env)  # an unknown name fails before any work
        self.renderers: dict[str, ChatRenderer] = {}
        """By the ``repr`` of the tools' schemas (:meth:`renderer`)."""
        self.renderers_lock = threading.Lock()
        self.stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    # ------------------------------------------------------------------ episodes
    def start(self, index: int, prompt: Any) -> Episode:
        info = dict(prompt.extra_info or {})
        name = info.get("env") or self.config.env
        kwargs = info.get("env_kwargs") or self.config.env_kwargs
        env = self.environments.get_environment_cls(name)(**kwargs)
        row = {
            "prompt": prompt.messages,
            "data_source": prompt.data_source,
            "ground_truth": prompt.ground_truth,
            "extra_info": info,
        }
        renderer = self.renderer(env.tool_schemas())
        ids = renderer.initial(env.reset(row))
        if len(ids) > self.prompt_limit:
            raise ValueError(
                f"environment {name!r}'s first observation is {len(ids)} tokens with its tools' schemas, "
                f"more than rollout.prompt_length={self.prompt_limit}: raise rollout.prompt_length"
            )
        tools = {fn.__name__: fn for fn in env.tools}
        return Episode(index, prompt, env, tools, renderer, Trajectory(ids))

    def renderer(self, tools: list[dict[str, Any]]) -> ChatRenderer:
        """The renderer of episodes whose tools have these schemas, shared by them on any thread (it keeps the
        template's fixed renders and the ids of recent first observations); the last :data:`~.tito.KEPT` kinds
        are kept."""
        key = repr(tools)
        renderer = self.renderers.get(key)
        if renderer is None:
            with self.renderers_lock:
                if len(self.renderers) >= KEPT:
                    self.renderers.clear()
                renderer = self.renderers.setdefault(key, ChatRenderer(self.tokenizer, tools))
        return renderer

    def _sample_turn(self, live: list[Episode], sampling: SamplingConfig, rollout: BaseRollout, turn: int):
        contexts = [e.traj.context() for e in live]
        budget = min(self.turn_tokens, self.context_limit - max(len(c) for c in contexts))
        seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + turn * 7919) % (2**31)
        call = dataclasses.replace(
            sampling, n=1, max_new_tokens=budget, seed=seed, stop_token_ids=self.stop_ids
        )
        return rollout.generate(contexts, call)

    def _take(self, e: Episode, sample: RolloutSample) -> Turn | None:
        """Append the sample; the turn to run, or None when the episode is truncated by length."""
        room = self.episode_tokens - len(e.traj.ids)
        ids, lps = sample.response_ids[:room], sample.log_probs[:room]
        e.traj.add_model(ids, lps)
        e.turns += 1
        if len(ids) < len(sample.response_ids) or len(e.traj.ids) >= self.episode_tokens:
            e.truncate("episode_tokens")
            return None
        if sample.finish_reason != "stop":
            e.truncate("length")
            return None
        text = self.codec.decode(ids[:-1])
        parsed = self.parser.parse(text, e.renderer.tools)  # the schemas the model was shown type its values
        turn = Turn(text, parsed.calls)
        e.stats["tool_calls"] += len(parsed.calls) + len(parsed.malformed)
        e.stats["malformed"] += len(parsed.malformed)
        turn.tool_results = [ToolResult("?", f"error: {m}", "malformed") for m in parsed.malformed]
        return turn

    def _answer(self, e: Episode, turn: Turn, result: StepResult, last_turn: bool) -> None:
        """Append the tool results and the observation, or end the episode."""
        if result.done:
            e.done, e.reward = True, result.reward
            return
        if last_turn:
            e.truncate("max_turns")
            return
        messages = []
        for r in turn.tool_results:
            content, cut = self.runner.cap(r.content)
            e.stats["tool_truncated"] += cut
            messages.append({"role": "tool", "name": r.name, "content": content})
        ids = e.renderer.continuation([*messages, *result.observation], e.traj.ids[-1])
        if len(e.traj.ids) + len(ids) >= self.episode_tokens:
            e.truncate("episode_tokens")
            return
        e.traj.add_env(ids)

    def _finish_turn(self, e: Episode, turn: Turn, results: list[ToolResult], turn_index: int) -> None:
        turn.tool_results += results
        e.stats.update(r.error for r in results if r.error is not None)
        self._answer(e, turn, e.env.step(turn), turn_index == self.config.max_turns - 1)

    def _tools_and_step(self, e: Episode, turn: Turn, turn_index: int) -> None:
        (results,) = self.runner.run([(turn.tool_calls, e.tools)])
        self._finish_turn(e, turn, results, turn_index)

    def run_episodes(self, rollout: BaseRollout, prompts: Sequence[Any], sampling: SamplingConfig):
        """(episodes grouped by prompt, seconds generating, seconds running tools and the environment)."""
        episodes = [self.start(i, p) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        if self.config.loop == "async":
            return episodes, *asyncio.run(self._run_async(episodes, rollout, sampling))
        gen_s = tool_s = 0.0
        for turn_index in range(self.config.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            start = time.perf_counter()
            samples = self._sample_turn(live, sampling, rollout, turn_index)
            gen_s += time.perf_counter() - start
            start = time.perf_counter()
            turns = [(e, self._take(e, s)) for e, s in zip(live, samples)]
            turns = [(e, t) for e, t in turns if t is not None]
            results = self.runner.run([(t.tool_calls, e.tools) for e, t in turns])
            for (e, t), res in zip(turns, results):
                self._finish_turn(e, t, res, turn_index)
            tool_s += time.perf_counter() - start
        return episodes, gen_s, tool_s

    # ------------------------------------------------------------------ asynchronous episodes
    def check_rollout(self, rollout: Any) -> None:
        """Refuse a rollout the configured loop cannot drive: ``agent.loop=async`` needs single requests."""
        if self.config.loop == "async" and not serves_requests(rollout):
            raise ValueError(
                f"agent.loop=async needs a rollout that generates one request at a time (agenerate): "
                f"{type(rollout).__name__} does not; use rollout.name=vllm with rollout.executor=server, or "
                "agent.loop=batched"
            )

    async def _run_async(self, episodes: list[Episode], rollout: Any, sampling: SamplingConfig):
        """Every episode on its own (``agent.loop=async``): (seconds waiting for generations, seconds waiting
        for tools and the environment), summed over episodes."""
        self.check_rollout(rollout)
        totals = await asyncio.gather(
            *(self.play(k, e, rollout.agenerate, sampling) for k, e in enumerate(episodes))
        )
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    async def play(self, k: int, e: Episode, generate: Generate, sampling: SamplingConfig):
        """Episode ``k`` of its call (seeds: ``sampling.prompt_seed(k)`` plus the turn): generate, then its
        tools on a worker thread, with no wait for other episodes; (seconds generating, seconds in tools and
        the environment). ``generate`` is ``rollout.agenerate``, or what the episode stream
        (:mod:`.stream`) puts in front of it."""
        gen_s = tool_s = 0.0
        for turn_index in range(self.config.max_turns):
            context = e.traj.context()
            seed = None
            if sampling.seed is not None:  # one request per episode: each needs its own seed
                seed = (sampling.prompt_seed(k) + turn_index * 7919) % (2**31)
            call = dataclasses.replace(
                sampling,
                n=1,
                seed=seed,
                stop_token_ids=self.stop_ids,
                max_new_tokens=min(self.turn_tokens, self.context_limit - len(context)),
            )
            start = time.perf_counter()
            (sample,) = await generate(context, call, e.index)
            gen_s += time.perf_counter() - start
            start = time.perf_counter()
            turn = self._take(e, sample)
            if turn is not None:  # tools and env.step on a worker thread: a slow one blocks no other episode
                await asyncio.get_running_loop().run_in_executor(
                    self.step_pool, self._tools_and_step, e, turn, turn_index
                )
            tool_s += time.perf_counter() - start
            if e.done:
                break
        return gen_s, tool_s

    # ------------------------------------------------------------------ batch
    def sample_and_score(
        self, rollout: BaseRollout, prompts: Sequence[Any], sampling: SamplingConfig, rewards
    ):
        """(samples grouped by prompt, scores, data sources, per-sample extras) as the RL trainer's
        ``sample_and_score`` returns them; ``rewards`` is its reward manager."""
        host = getattr(rollout, "play_episodes", None)  # a rollout process runs the loop itself (rl.remote)
        if host is not None:
            episodes, gen_s, tool_s = host(prompts, sampling)
        else:
            episodes, gen_s, tool_s = self.run_episodes(rollout, prompts, sampling)
        return self.rollouts_of(episodes, gen_s, tool_s, rewards)

    def rollouts_of(self, episodes: Sequence[Episode], gen_s: float, tool_s: float, rewards):
        """Finished episodes -> (samples, scores, data sources, per-sample extras), in the episodes' order;
        ``gen_s`` and ``tool_s`` are the seconds generating and in tools behind them (for the metrics)."""
        scores = self.score(episodes, rewards)
        samples = [
            RolloutSample(
                prompt_index=e.index,
                prompt_ids=e.traj.prompt_ids,
                response_ids=e.traj.ids,
                log_probs=torch.tensor(e.traj.log_probs, dtype=torch.float32),
                finish_reason="length" if e.truncated else "stop",
                response_mask=e.traj.mask,
            )
            for e in episodes
        ]
        extras = episode_metrics(episodes, gen_s, tool_s)
        return samples, scores, [e.prompt.data_source for e in episodes], extras

    def score(self, episodes: Sequence[Episode], rewards) -> list[float]:
        """The environment's reward, else the reward function's over the decoded trajectory; truncated
        episodes take ``agent.truncated_reward`` when it is set."""
        fixed = self.config.truncated_reward
        scores: list[float | None] = [
            fixed if (e.truncated and fixed is not None) else e.reward for e in episodes
        ]
        todo = [i for i, s in enumerate(scores) if s is None]
        if todo:
            picked = [episodes[i] for i in todo]
            texts = self.tokenizer.batch_decode([e.traj.ids for e in picked], skip_special_tokens=True)
            out = rewards(
                [e.prompt.data_source for e in picked],
                texts,
                [e.prompt.ground_truth for e in picked],
                [e.prompt.extra_info for e in picked],
            )
            for i, s in zip(todo, out.scores):
                scores[i] = s
        return [float(s) for s in scores]

    def close(self) -> None:
        self.runner.close()
        self.step_pool.shutdown(wait=False, cancel_futures=True)


def episode_metrics(episodes: Sequence[Episode], gen_s: float, tool_s: float) -> dict[str, list[float]]:
    """Per-episode values (the trainer logs their means as ``reward/extra/agent/<key>/mean``): turns, tool
    calls, tool errors by kind, tool results cut, truncations by reason, and the step's share of loop time
    spent in tools and the environment rather than generating."""
    share = tool_s / max(gen_s + tool_s, 1e-9)
    out: dict[str, list[float]] = {
        "agent/turns": [float(e.turns) for e in episodes],
        "agent/tool_calls": [float(e.stats["tool_calls"]) for e in episodes],
        "agent/tool_truncated": [float(e.stats["tool_truncated"]) for e in episodes],
        "agent/truncated": [float(e.truncated is not None) for e in episodes],
        "agent/tool_time_share": [share] * len(episodes),
        "agent/generate_s": [gen_s] * len(episodes),
        "agent/tool_s": [tool_s] * len(episodes),
    }
    for kind in ERROR_KINDS:
        out[f"agent/tool_errors/{kind}"] = [float(e.stats[kind]) for e in episodes]
    for why in ("length", "episode_tokens", "max_turns"):
        out[f"agent/truncated/{why}"] = [float(e.truncated == why) for e in episodes]
    return out
