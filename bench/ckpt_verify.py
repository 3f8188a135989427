"""Cost of checkpoint verification: a verified against an unverified save and load of a model with AdamW state.

Verified (the default of ``save_role``/``load_role``): the save computes every tensor's row-hash checksum on its
device and refuses NaN/inf, then re-reads each written file for its segment CRCs; the load re-reads every file
against them before DCP reads it, then checks the loaded tensors' checksums and finiteness. Unverified:
``verify=False`` (no checksums recorded, none checked). Each round runs, interleaved, a verified and an
unverified save (``CheckpointManager.stage`` + ``save_role`` + ``commit``) and a verified and an unverified
load, the page cache of the files dropped before each load; the medians over ``--rounds`` and the overhead are
printed (and written with ``--json``).

With ``--baseline COMMIT`` each round runs twice more, as a subprocess of this script with ``--rounds 1``: once
with the baseline's ``packages/*/src`` (``git archive``) first on ``PYTHONPATH`` and once with this tree's, the
two alternating; the medians of both are printed side by side (same venv, same machine, same run).

    python bench/ckpt_verify.py --shape small --rounds 3            # CPU, ~100 MB of state
    python bench/ckpt_verify.py --shape small --rounds 3 --baseline 1b3d3c9   # against an earlier verification
    python bench/ckpt_verify.py --shape 1.5b --rounds 3 --dir /tmp/ckpt_bench   # one GPU, ~18.5 GB
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from ckpt_throughput import SHAPES, build, drop_cache, sync_device

from posttrain.ckpt import CheckpointManager, RoleInfo, RoleState, load_role, save_role
from posttrain.core.config import CheckpointConfig

CONTENTS = ["model", "optimizer", "extra"]
SMALL = {
    **SHAPES["tiny"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
}


def save(root: Path, state: RoleState, step: int, verify: bool) -> float:
    mgr = CheckpointManager(root, CheckpointConfig(save_contents=CONTENTS, max_ckpt_to_keep=1))
    sync_device()
    t0 = time.perf_counter()
    staging = mgr.stage(step)
    save_role(staging / "actor", state, RoleInfo(), CONTENTS, step, verify=verify)
    mgr.save_trainer_state(step, {"global_step": step})
    mgr.commit(step)
    return time.perf_counter() - t0


def load(role: Path, state: RoleState, verify: bool) -> float:
    drop_cache(role)
    sync_device()
    t0 = time.perf_counter()
    load_role(role, state, CONTENTS, verify=verify)
    sync_device()
    return time.perf_counter() - t0


def against_baseline(args: argparse.Namespace) -> None:
    """Rounds of this script (``--rounds 1``) with the baseline's sources and with this tree's, alternating."""
    from config_show import _export

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {"baseline": env | {"PYTHONPATH": _export(args.baseline, Path(tmp))}, "this tree": env}
        for _ in range(args.rounds):
            for arm, arm_env in envs.items():
                out = Path(tmp) / "round.json"
                cmd = [sys.executable, __file__, "--shape", args.shape, "--rounds", "1"]
                subprocess.run([*cmd, "--dir", str(args.dir), "--json", str(out)], env=arm_env, check=True)
                runs[arm].append(json.loads(out.read_text())["median_s"])
    keys = ("save", "save_verified", "load", "load_verified")
    print(f"{'arm':<10} " + " ".join(f"{k:>14}" for k in keys) + f" {'overhead':>9}")
    summary = {}
    for arm, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        over = (med["save_verified"] + med["load_verified"]) / (med["save"] + med["load"]) - 1
        summary[arm] = {"median_s": med, "save_load_overhead": over, "rounds": rows}
        print(f"{arm:<10} " + " ".join(f"{med[k]:>14.3f}" for k in keys) + f" {over:>+9.1%}")
    if args.json:
        args.json.write_text(
            json.dumps({"baseline": args.baseline, "shape": args.shape, **summary}, indent=1)
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", "small", "1.5b"], default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_verify_bench"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--baseline", default=None, help="commit whose verification runs alternately with this tree's"
    )
    args = ap.parse_args()
    if args.baseline:
        return against_baseline(args)
    SHAPES["small"] = SMALL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, sched = build(args.shape, device)
    state = RoleState(model=model, optimizer=opt, lr_scheduler=sched)
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    times: dict[str, list[float]] = {k: [] for k in ("save", "save_verified", "load", "load_verified")}
    shutil.rmtree(args.dir, ignore_errors=True)
    for r in range(args.rounds):
        for verify in (False, True):  # interleaved: the disk's and the machine's drift fall on both alike
            root = args.dir / ("verified" if verify else "plain")
            suffix = "_verified" if verify else ""
            times[f"save{suffix}"].append(save(root, state, r + 1, verify))
            times[f"load{suffix}"].append(load(root / f"global_step_{r + 1}" / "actor", state, verify))
        print({k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "shape": args.shape,
        "device": str(device),
        "state_gb": nbytes / 1e9,
        "median_s": med,
        "save_overhead": med["save_verified"] / med["save"] - 1,
        "load_overhead": med["load_verified"] / med["load"] - 1,
        "save_load_overhead": (med["save_verified"] + med["load_verified"]) / (med["save"] + med["load"]) - 1,
        "rounds": times,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
