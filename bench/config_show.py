"""``posttrain config show`` start-up time: this tree against a baseline commit, interleaved round by round.

The baseline's ``packages/*/src`` are exported (``git archive``) to a temporary folder and put first on
``PYTHONPATH``, so both arms run the same venv, console script and entry points; only the source differs. Per
arm:
wall time of ``uv run posttrain config show`` (what a user types, uv's own check included), the CPU time
(user + sys) of the whole process tree, and the sum of the top-level ``python -X importtime`` entries.

    uv run python bench/config_show.py --baseline 93fac4f --rounds 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _export(rev: str, dest: Path) -> str:
    """``packages/`` at ``rev`` under ``dest``; the ``PYTHONPATH`` of its sources."""
    data = subprocess.run(
        ["git", "archive", rev, "packages"], cwd=REPO, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return os.pathsep.join(str(p) for p in sorted((dest / "packages").glob("*/src")))


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, user + sys s of the children) of one run of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _import_s(env: dict[str, str]) -> float:
    cmd = [sys.executable, "-X", "importtime", "-m", "posttrain.trainers.cli", "config", "show"]
    err = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True).stderr
    rows = [
        line.split("|") for line in err.splitlines() if line.startswith("import time:") and "[us]" not in line
    ]
    return sum(int(row[1]) for row in rows if row[2].startswith(" ") and not row[2].startswith("  ")) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="commit to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_env = dict(os.environ)
        base_env.pop("PYTHONPATH", None)
        envs = {
            "baseline": base_env | {"PYTHONPATH": _export(args.baseline, Path(tmp))},
            "this tree": base_env,
        }
        for _ in range(args.rounds):
            for arm, env in envs.items():
                wall, cpu = _timed(["uv", "run", "posttrain", "config", "show"], env)
                results[arm].append((wall, cpu, _import_s(env)))
    print(f"{'arm':<10} {'wall s (median, min-max)':<26} {'cpu s':<8} {'importtime s':<12}")
    for arm, rows in results.items():
        walls, cpus, imps = zip(*rows)
        span = f"{statistics.median(walls):.2f} ({min(walls):.2f}-{max(walls):.2f})"
        print(f"{arm:<10} {span:<26} {statistics.median(cpus):<8.2f} {statistics.median(imps):<12.2f}")


if __name__ == "__main__":
    main()
