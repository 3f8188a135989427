"""``trainer.mode=stream`` with the episode pool in the trainer's process or in its rollout process,
alternating.

Runs ``posttrain grpo`` (docs/agents.md's stream settings: the tiny model, the calculator env, the HF rollout
on the CPU) once per placement per round (ABBA order, after one uncounted warm-up run), and prints, per
placement and as process/colocated, the median over runs of each phase's mean seconds over the steps between
the first and the last, and of tokens/s over them; each run's value too. What it isolates: the trainer's
phases beside the pool. Colocated, the pool's event loop and the rollout's Python share the trainer's
interpreter lock (the random tiny model calls no tools); in a process they share only the two cores, where
torch's threads of both compete too. Read the ratio as this CPU's, not a GPU's.

    python bench/agent_placement.py --rounds 4 --steps 6 --out /tmp/agent_placement
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

KEYS = {
    "wait_rollout": "timing_s/wait_rollout",
    "wait_pause": "timing_s/wait_pause",
    "update_weights": "timing_s/update_weights",
    "old_log_prob": "timing_s/old_log_prob",
    "update_actor": "timing_s/update_actor",
    "step_s": "perf/step_s",
    "tokens": "perf/tokens",
}
"""Printed name -> metrics.jsonl key."""


def run(out: Path, placement: str, k: int, steps: int, model: str, data: str) -> list[dict]:
    run_dir = out / f"{placement}-{k}"
    cmd = [
        "posttrain", "grpo", "--config", "grpo_tiny", f"model.path={model}",
        f"data.train_files=[{data}/train.parquet]", "data.val_files=[]",
        "agent.env=calculator", "agent.loop=async", "agent.max_turns=3", "agent.max_tokens_per_turn=48",
        "rollout.prompt_length=96", "rollout.response_length=160", "trainer.mode=stream",
        "trainer.max_staleness=2", f"trainer.total_training_steps={steps}", "trainer.save_freq=-1",
        "trainer.logger=[file]", f"trainer.rollout_placement={placement}",
        f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("/tmp/agent_placement"))
    args = ap.parse_args()
    model, data = args.out / "tiny", args.out / "arith"
    if not (model / "config.json").exists():
        subprocess.run(["posttrain", "model", "init", "--size", "tiny", "--out", str(model)], check=True)
    if not (data / "train.parquet").exists():
        subprocess.run(
            ["posttrain", "data", "synthetic", "--task", "arithmetic", "--digits", "2", "--num-train", "400",
             "--num-test", "20", "--out", str(data)], check=True,
        )  # fmt: skip
    run(args.out, "colocated", -1, 2, str(model), str(data))  # warm-up, not counted: caches, first imports
    per_run: dict[str, list[dict[str, float]]] = {"colocated": [], "process": []}
    for k in range(args.rounds):
        order = ("colocated", "process") if k % 2 == 0 else ("process", "colocated")  # ABBA
        for placement in order:
            # not the first step (start-up) nor the last (its groups were banked: nothing left to generate)
            rows = run(args.out, placement, k, args.steps, str(model), str(data))[1:-1]
            per_run[placement].append(
                {ph: statistics.mean(float(r.get(key, 0.0)) for r in rows) for ph, key in KEYS.items()}
            )
            print(f"round {k} {placement} done", file=sys.stderr)
    report(per_run)


def report(per_run: dict[str, list[dict[str, float]]]) -> None:
    """Per placement, the median over runs of each run's mean per step; tokens/s is each run's tokens over its
    seconds, median over runs."""
    for runs in per_run.values():
        for r in runs:
            r["tokens/s"] = r["tokens"] / r["step_s"]
    print(
        f"{'median of runs':<16}{'colocated':>12}{'process':>12}{'ratio':>8}   per run (colocated | process)"
    )
    for ph in [*KEYS, "tokens/s"]:
        a, b = (statistics.median(r[ph] for r in per_run[p]) for p in ("colocated", "process"))
        each = " ".join(f"{r[ph]:.3f}" for r in per_run["colocated"]) + " | "
        each += " ".join(f"{r[ph]:.3f}" for r in per_run["process"])
        print(f"{ph:<16}{a:>12.3f}{b:>12.3f}{(b / a if a else float('nan')):>8.2f}   {each}")


if __name__ == "__main__":
    main()
