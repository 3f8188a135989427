"""The peer of bench/rl_throughput.py: TRL's GRPOTrainer on the same model, prompts, lengths and batch.

TRL 1.16 (``pip install trl==1.16.0``; it accepts vLLM 0.22-0.31) with ``use_vllm=True, vllm_mode="colocate"``
(vLLM in the training process, sleep mode on, as posttrain's rollout sleeps while training), on the model dir
and prompt parquet that bench/rl_throughput.py writes (the same ``--workdir``): the prompts go in as a
``datasets.Dataset`` of chat messages, which TRL renders with the same chat template to the same
``--prompt-len`` tokens. Same lengths (``max_completion_length`` = ``--response-len``), same batch (``n``
generations of each of ``prompts`` prompts per GPU), one optimizer step per generation batch
(``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = the generation batch), bf16 autocast over
fp32 weights with gradient checkpointing, KL to a reference (``beta`` 0.001), lr 1e-6, and a trivial reward
(1 when the text holds ``#### 7``, the answer posttrain's rule reward looks for).

Reported per run, in bench/rl_throughput.py's JSON format: step time (``on_step_begin`` to ``on_step_end`` of
the transformers Trainer: generation, scoring, forward passes, backward and optimizer), tokens/s/GPU (prompt +
completion tokens from TRL's ``num_tokens`` log), the seconds in vLLM generation (``gen``) and weight sync
(``update_weights``), response lengths and peak memory. ``--report RL.jsonl TRL.jsonl`` prints posttrain's
step time over TRL's for every work, shape and GPU count both files hold.

    python3 bench/trl_grpo.py --shapes 0.5b --json trl.jsonl                  # on the GPU machine
    uv run --with trl==1.16.0 python bench/trl_grpo.py --tiny --no-vllm       # CPU check of the TRL side
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_throughput as rl  # noqa: E402  (the model, data, launcher and report shared with the posttrain run)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, short sequences, fp32")
    p.add_argument(
        "--work",
        default=None,
        help="comma list of bench, readme, small, tiny (default bench; tiny with --tiny)",
    )
    p.add_argument("--shapes", default=None, help="comma list of model sizes for --work bench (default 0.5b)")
    p.add_argument("--launchers", default="torchrun", help="comma list of process, torchrun")
    p.add_argument("--gpus", type=int, default=1, help="torchrun processes (the process launch uses one)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step and GPU (default: the work's)")
    p.add_argument("--n", type=int, default=None, help="generations per prompt (default: the work's)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: the work's)")
    p.add_argument(
        "--response-len", type=int, default=None, help="max_completion_length (default: the work's)"
    )
    p.add_argument("--micro", type=int, default=16, help="per_device_train_batch_size (completions)")
    p.add_argument("--no-vllm", action="store_true", help="generate with transformers (a CPU check)")
    p.add_argument("--no-kl", action="store_true", help="beta=0: no reference model")
    p.add_argument("--no-grad-ckpt", action="store_true", help="no gradient checkpointing")
    p.add_argument("--vllm-mem", type=float, default=0.5, help="vllm_gpu_memory_utilization")
    p.add_argument(
        "--workdir", default=None, help="shared with bench/rl_throughput.py (default /tmp/rl_bench)"
    )
    p.add_argument("--json", default=None, help="append one JSON line per run to this file")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a run is killed")
    p.add_argument("--report", nargs=2, metavar=("RL", "TRL"), help="print posttrain's step time over TRL's")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- one run
def reward_answer(completions: list, **_: Any) -> list[float]:
    """1.0 when the completion holds ``#### 7``, else 0.0 (conversational completions are message lists)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float("#### 7" in t) for t in texts]


def grpo_config(spec: dict[str, Any]) -> Any:
    """GRPOConfig for one generation batch (``prompts`` x ``n`` completions per GPU) per optimizer step."""
    from trl import GRPOConfig

    w = spec["work"]
    per_gpu = w["prompts"] * w["n"]
    if per_gpu % spec["micro"]:
        raise ValueError(f"--micro {spec['micro']} must divide the {per_gpu} completions per GPU of a step")
    kwargs: dict[str, Any] = {}
    if spec["vllm"]:
        kwargs = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=spec["vllm_mem"],
            vllm_enable_sleep_mode=True,
            vllm_max_model_length=w["prompt_len"] + w["response_len"],
        )
    return GRPOConfig(
        output_dir=spec["run_dir"],
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=per_gpu // spec["micro"],
        num_generations=w["n"],
        max_completion_length=w["response_len"],
        temperature=1.0,
        learning_rate=1e-6,
        beta=spec["beta"],
        bf16=w["bf16"],
        gradient_checkpointing=spec["grad_ckpt"],
        max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        seed=1,
        use_cpu=not w["bf16"],
        **kwargs,
    )


def step_timer(trainer: Any) -> Any:
    """A TrainerCallback recording each optimizer step's wall time and logs, and the time vLLM generation and
    weight sync took inside it (their methods wrapped with a clock)."""
    from transformers import TrainerCallback

    spent = {"gen": 0.0, "update_weights": 0.0}
    gen = getattr(trainer, "vllm_generation", None)
    for phase, method in (("gen", "generate"), ("update_weights", "sync_weights")):
        if gen is not None:
            setattr(gen, method, clocked(getattr(gen, method), spent, phase))

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()
            spent.update(gen=0.0, update_weights=0.0)

        def on_step_end(self, args, state, control, **kwargs):
            row = {"wall_s": time.perf_counter() - self.t0}
            row.update({f"timing_s/{k}": v for k, v in spent.items() if gen is not None})
            self.steps.append(row)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs and self.steps:
                self.steps[-1].update({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    return StepTimer()


def clocked(fn: Any, spent: dict[str, float], phase: str) -> Any:
    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[phase] += time.perf_counter() - t0

    return timed


def worker(spec_path: str) -> None:
    """Train ``warmup + steps`` optimizer steps with GRPOTrainer and write this rank's result."""
    import os
    from importlib.metadata import version

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    # TRL's colocated vLLM loads weights through llm_engine.model_executor: the engine must live in this
    # process (vLLM also turns this off itself for the external launcher TRL uses).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows = pq.read_table(spec["data"], columns=["prompt"]).to_pylist()
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=reward_answer, args=grpo_config(spec), train_dataset=dataset
    )
    init_s = time.perf_counter() - start
    timer = step_timer(trainer)
    trainer.add_callback(timer)
    device = trainer.accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = rl.MemoryPeak(device)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    result = {
        "rank": rank,
        "trl": version("trl"),
        "init_s": init_s,
        "all_steps": timer.steps,
        "peak_device_gib": peak.close(),
        "peak_torch_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    Path(spec["result"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the launcher
def summarize(results: list[dict], world: int, warmup: int) -> dict[str, Any]:
    """bench/rl_throughput.py's row fields from TRL's per-step logs (``num_tokens`` is cumulative)."""
    every = results[0]["all_steps"]
    if len(every) <= warmup or any("num_tokens" not in s for s in every):
        raise ValueError(f"TRL logged {len(every)} steps, some without num_tokens: expected {warmup} + timed")
    cumulative = [0.0] + [s["num_tokens"] for s in every]
    steps = every[warmup:]
    tokens = rl.mean([cumulative[i + 1] - cumulative[i] for i in range(warmup, len(every))])
    step_s = rl.mean([s["wall_s"] for s in steps])
    row: dict[str, Any] = {
        "trl": results[0]["trl"],
        "step_s": round(step_s, 3),
        "tokens_per_step": round(tokens),
        "tokens_per_s_per_gpu": round(tokens / step_s / world, 1),
        "response_len_mean": round(rl.mean([s["completions/mean_length"] for s in steps]), 1),
        "clip_ratio": round(rl.mean([s.get("completions/clipped_ratio", 0.0) for s in steps]), 3),
        "init_s": round(results[0]["init_s"], 1),
    }
    for name in ("gen", "update_weights"):
        if f"timing_s/{name}" in steps[0]:
            sec = rl.mean([s[f"timing_s/{name}"] for s in steps])
            row[f"{name}_s"], row[f"{name}_share"] = round(sec, 3), round(sec / step_s, 3)
    for key in ("peak_torch_gib", "peak_device_gib"):
        seen = [r[key] for r in results if r[key] is not None]
        row[key] = max(seen) if seen else None
    return row


def report(rl_path: str, trl_path: str) -> str:
    """posttrain's step time over TRL's, for every (work, shape, GPUs, rollout) both files hold."""
    load = lambda p: [json.loads(x) for x in Path(p).read_text().splitlines() if x.strip()]  # noqa: E731
    ours = [r for r in load(rl_path) if "error" not in r]
    lines = []
    for peer in (r for r in load(trl_path) if "error" not in r):
        key = ("work", "shape", "gpus", "rollout")
        for r in (o for o in ours if all(o[k] == peer[k] for k in key)):
            lines.append(
                f"{r['work']} {r['shape']} {r['gpus']} GPU rollout={r['rollout']}: posttrain "
                f"({r['launcher']}) {r['step_s']:.2f} s/step, {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU; TRL "
                f"{peer['trl']} {peer['step_s']:.2f} s/step, {peer['tokens_per_s_per_gpu']:.0f} tok/s/GPU; "
                f"posttrain/TRL step time {r['step_s'] / peer['step_s']:.2f} (TRL/posttrain "
                f"{peer['step_s'] / r['step_s']:.2f}x)"
            )
    return "\n".join(lines) or "no (work, shape, gpus, rollout) appears in both files"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(*args.report))
        return 0
    if args.worker:
        worker(args.worker)
        return 0
    args.tokens_per_gpu = None  # rl.plan reads it; TRL has no token budget per micro-batch
    workdir = Path(args.workdir or "/tmp/rl_bench")
    rows, sha = [], rl.commit()
    for name, work in rl.plan(args):
        model = rl.prepare_model(workdir, work.shape, work.vocab)
        data = rl.prepare_data(workdir, model, work, work.prompts * args.gpus * (args.warmup + args.steps))
        for launcher in rl.csv(args.launchers, "torchrun"):
            world = args.gpus if launcher == "torchrun" else 1
            rollout = "hf" if args.no_vllm else "vllm"
            label = {
                "work": name,
                "shape": work.shape,
                "rollout": rollout,
                "launcher": launcher,
                "gpus": world,
            }
            run_dir = workdir / "runs" / ("trl-" + "-".join(str(v) for v in label.values()))
            spec = {
                "model": str(model),
                "data": str(data),
                "run_dir": str(run_dir),
                "work": asdict(work),
                "micro": args.micro,
                "vllm": not args.no_vllm,
                "vllm_mem": args.vllm_mem,
                "beta": 0.0 if args.no_kl else 0.001,
                "grad_ckpt": not args.no_grad_ckpt and work.bf16,
                "warmup": args.warmup,
                "steps": args.steps,
            }
            print(f"[trl-bench] {label} ...", file=sys.stderr, flush=True)
            got = rl.launch(spec, launcher, world, run_dir, args.timeout, script=__file__)
            row = {"bench": "trl_grpo", "commit": sha, **label, **asdict(work)}
            row.update({"warmup": args.warmup, "steps": args.steps, "prompts": work.prompts * world})
            row.update(summarize(got, world, args.warmup) if isinstance(got, list) else {"error": got})
            rows.append(row)
            rl.emit(row, args.json)
    print("\n" + rl.table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
