"""``trainer.mode=stream`` with the episode pool in the trainer's process or in its rollout process, alternating.

Runs ``posttrain grpo`` (docs/agents.md's stream settings: the tiny model, the calculator env, the HF rollout on
the CPU) once per placement per round, and prints, per placement and as process/colocated, each phase's mean
seconds over the steps between the first and the last, and tokens/s over them. What it isolates: the trainer's
phases beside the pool. Colocated, the pool's event loop, its tools and the rollout's Python share the trainer's
interpreter lock; in a process they share only the cores. On a CPU the rollout also computes on those cores, so
the two placements differ in more than the lock: read the ratio as the CPU's, not a GPU's.

    python bench/agent_placement.py --rounds 3 --steps 6 --out /tmp/agent_placement
"""

from __future__ import annotations

import argparse
import json
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
        "trainer.logger=[file]", f"trainer.rollout_placement={placement}", f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    seconds: dict[str, dict[str, list[float]]] = {
        p: {ph: [] for ph in KEYS} for p in ("colocated", "process")
    }
    for k in range(args.rounds):
        for placement in ("colocated", "process"):
            # not the first step (start-up) nor the last (its groups were banked: nothing left to generate)
            for row in run(args.out, placement, k, args.steps, str(model), str(data))[1:-1]:
                for ph, key in KEYS.items():
                    seconds[placement][ph].append(float(row.get(key, 0.0)))
            print(f"round {k} {placement} done", file=sys.stderr)
    print(f"{'mean per step':<16}{'colocated':>12}{'process':>12}{'ratio':>8}")
    for ph in KEYS:
        a, b = (sum(v) / max(len(v), 1) for v in (seconds["colocated"][ph], seconds["process"][ph]))
        print(f"{ph:<16}{a:>12.3f}{b:>12.3f}{(b / a if a else float('nan')):>8.2f}")
    a, b = (sum(seconds[p]["tokens"]) / sum(seconds[p]["step_s"]) for p in ("colocated", "process"))
    print(f"{'tokens/s':<16}{a:>12.1f}{b:>12.1f}{b / a:>8.2f}")


if __name__ == "__main__":
    main()
