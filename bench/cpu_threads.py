"""SFT step time on this CPU with 1 torch thread, with one per core, and with ``threads.configure``'s choice.

Runs ``posttrain sft --config sft_tiny`` (tiny offline model, synthetic arithmetic) for ``--steps`` steps per
arm, the arms interleaved round by round (A, B, C, A, B, C, ...) so that a shared machine's changing load
falls on all of them alike, and prints the median and range of ``perf/step_s`` (steps after the first) per
arm.

    uv run python bench/cpu_threads.py --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = {"OMP_NUM_THREADS=1": "1", "OMP_NUM_THREADS=<cores>": str(len(os.sched_getaffinity(0))), "auto": None}


def _run(cmd: list[str], env: dict[str, str]) -> str:
    return subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    exe = [sys.executable, "-m", "posttrain.trainers.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = dict(os.environ)
        base.pop("OMP_NUM_THREADS", None)
        _run(
            [*exe, "model", "init", "--size", "tiny", "--out", str(root / "model")],
            base | {"OMP_NUM_THREADS": "1"},
        )
        _run([*exe, "data", "synthetic", "--out", str(root / "data")], base | {"OMP_NUM_THREADS": "1"})
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm, omp in ARMS.items():
                env = base | ({"OMP_NUM_THREADS": omp} if omp else {})
                out = root / f"run_{r}_{len(times[arm])}_{omp}"
                log = _run(
                    [
                        *exe,
                        "sft",
                        "--config",
                        "sft_tiny",
                        f"model.path={root / 'model'}",
                        f"data.train_files={root / 'data' / 'train.parquet'}",
                        f"trainer.default_local_dir={out}",
                        "trainer.logger=[file]",
                        f"trainer.total_training_steps={args.steps}",
                        "trainer.test_freq=-1",
                        "checkpoint.save_contents=[model]",
                    ],
                    env,
                )
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                times[arm] += [row["perf/step_s"] for row in rows[1:]]
                chosen = [x for x in log.splitlines() if x.startswith("torch CPU threads")]
                print(
                    f"round {r} {arm}: {statistics.median(times[arm][-len(rows) + 1 :]):.3f} s/step"
                    + (f"  [{chosen[0]}]" if chosen else ""),
                    flush=True,
                )
        print(f"load average at the end: {os.getloadavg()}")
        for arm, ts in times.items():
            print(
                f"{arm:>24}: median {statistics.median(ts):.3f} s/step, min {min(ts):.3f}, max {max(ts):.3f} "
                f"({len(ts)} steps)"
            )


if __name__ == "__main__":
    main()
