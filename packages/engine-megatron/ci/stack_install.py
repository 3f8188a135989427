"""Install the built posttrain-engine-megatron wheel into a Megatron user's stack with plain pip; nothing in
it moves.

The stack stands in for an NGC-style environment: torch, a transformers newer than Megatron-Bridge's cap, the
newest numpy, megatron-core 0.19.2 and Megatron-Bridge 0.6.2 installed without their dependencies (as from
source). The script builds the engine-core, ckpt and engine-megatron wheels, records ``pip list``, runs
``pip install <engine-megatron wheel> --find-links <dist>``, records ``pip list`` again and fails when a
package of the stack was up- or downgraded or removed. Then the engine must import and resolve through its
entry points.

    python packages/engine-megatron/ci/stack_install.py WORK_DIR [--python PYTHON]

Run by the nox session ``megatron_install``. Needs uv (venv and the stack, from uv's cache) and PyPI (pip adds
posttrain's own small dependencies the stack lacks, e.g. omegaconf).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ["posttrain-engine-core", "posttrain-ckpt", "posttrain-engine-megatron"]
# The user's stack. transformers and numpy are newer than what Megatron-Bridge 0.6.2 pins / the workspace
# locks.
STACK = ["torch==2.14.0", "transformers==5.24.0", "numpy==2.5.5", "packaging"]
STACK_NO_DEPS = ["megatron-core==0.19.2", "megatron-bridge==0.6.2"]
IMPORT_CHECK = """
import posttrain.megatron.build
from posttrain.core.registry import engine_config_class
cfg = engine_config_class("megatron")()
print("config ->", type(cfg).__name__)
for model_type in ("language_model", "value_model"):
    print(model_type, "->", cfg.engine_class(model_type).__name__)
"""


def run(*cmd: str) -> str:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"+ {' '.join(cmd)[:200]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if proc.returncode:
        sys.exit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def installed(python: str) -> dict[str, str]:
    rows = json.loads(run(python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"))
    return {r["name"].lower().replace("_", "-"): r["version"] for r in rows}


def diff(before: dict[str, str], after: dict[str, str]) -> tuple[list[str], list[str]]:
    """(changed or removed packages of the stack, added packages)."""
    changed = [
        f"{n} {v} -> {after.get(n, 'removed')}" for n, v in sorted(before.items()) if after.get(n) != v
    ]
    added = [f"{n}=={v}" for n, v in sorted(after.items()) if n not in before]
    return changed, added


def build_stack(work: Path, python: str) -> tuple[Path, str]:
    dist = work / "dist"
    for package in PACKAGES:
        cmd = ["uv", "build", "--python", python, "--no-sources", "--wheel", "--package", package]
        run(*cmd, "--out-dir", str(dist), "--directory", str(ROOT))
    venv = work / "stack"
    run("uv", "venv", "--no-config", "--seed", "--clear", "--python", python, str(venv))
    vpy = str(venv / "bin" / "python")
    run("uv", "pip", "install", "--no-config", "--python", vpy, *STACK)
    run("uv", "pip", "install", "--no-config", "--python", vpy, "--no-deps", *STACK_NO_DEPS)
    return dist, vpy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="scratch folder (wheels and the stack's venv)")
    ap.add_argument("--python", default=sys.executable, help="Python 3.12 for the stack's venv")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dist, vpy = build_stack(args.work, args.python)
    before = installed(vpy)
    wheel = next(dist.glob("posttrain_engine_megatron-*.whl"))
    out = run(
        vpy, "-m", "pip", "install", "--disable-pip-version-check", str(wheel), "--find-links", str(dist)
    )
    print(out[-3000:])
    changed, added = diff(before, installed(vpy))
    print(f"stack: {len(before)} packages; pip added {len(added)}: {' '.join(added)}")
    if changed:
        print("FAIL: pip install changed the user's stack:\n  " + "\n  ".join(changed), file=sys.stderr)
        return 1
    print(run(vpy, "-c", IMPORT_CHECK))
    print(f"ok: nothing in the stack moved ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
