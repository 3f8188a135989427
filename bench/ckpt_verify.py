"""Cost of checkpoint verification: a verified against an unverified save and load of a model with AdamW
state.

Verified (the default of ``save_role``/``load_role``): the save computes every tensor's row-hash checksum on
its device and refuses NaN/inf, then re-reads each written file for its segment CRCs; the load re-reads every
file against them before DCP reads it, then checks the loaded tensors' checksums and finiteness. Unverified:
``verify=False`` (no checksums recorded, none checked). Each round runs an unverified and a verified arm, each
a save (``CheckpointManager.stage`` + ``save_role`` + ``commit``) and then a load, the page cache of the files
dropped before each load; the arms' order alternates from round to round. The medians and minima over
``--rounds`` and the overheads are printed (and written with ``--json``).

With ``--baseline COMMIT`` each round runs twice more, as a subprocess of this script with ``--rounds 1``:
once with the baseline's ``packages/*/src`` (``git archive``) first on ``PYTHONPATH`` and once with this
tree's, which goes first alternating; the medians of both are printed side by side (same venv, same machine,
same run), with ``--phases`` each one's phases too.

``--load-schedules N`` then loads the last verified checkpoint N more times per schedule of the load's file
check (as it is; with WILLNEED read-ahead; in name order instead of DCP's read order; and unverified), to see
which one DCP's read suffers least from on the disk at hand.

``--phases`` also times, per arm and round, the steps a save and a load go through (:data:`PHASES`: the
tensor checksums, DCP's write and read, the file CRCs, the manifest, the commit's fsync, the load's wait for
its file check and its tensor check), by wrapping those functions in this process; their medians are printed
per arm.

    python bench/ckpt_verify.py --shape small --rounds 3            # CPU, ~200 MB of state
    python bench/ckpt_verify.py --shape medium --rounds 3 --phases   # CPU, ~1.9 GB, time per phase
    python bench/ckpt_verify.py --shape small --rounds 3 --baseline 1b3d3c9  # against an earlier verification
    python bench/ckpt_verify.py --shape 1.5b --rounds 3 --dir /tmp/ckpt_bench   # one GPU, ~18.5 GB
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
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
MEDIUM = {
    **SMALL,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
}
ARMS = ("save", "save_verified", "load", "load_verified")
PHASES = (
    ("posttrain.ckpt.role", "gathered_records", "tensor checksums", "call"),
    ("torch.distributed.checkpoint", "save", "dcp write", "call"),
    ("posttrain.ckpt.role", "role_file_records", "file crcs", "call"),
    ("posttrain.ckpt.role", "syncing", "fsync wait", "exit"),
    ("posttrain.ckpt.role", "write_json", "role manifest", "call"),
    ("posttrain.ckpt.manager", "file_record", "commit crcs", "call"),
    ("posttrain.ckpt.manager", "fsync_tree", "commit fsync", "call"),
    ("torch.distributed.checkpoint", "load", "dcp read", "call"),
    ("posttrain.ckpt.role", "verified_read", "file check wait", "exit"),
    ("posttrain.ckpt.role", "check_loaded", "tensor checks", "call"),
)
"""(module, function, phase, how) timed with ``--phases``; a function the module lacks is skipped (an older
tree's sources with ``--baseline``). ``call``: the function's seconds; ``exit``: a context manager's, from the
end of its body to its exit: ``syncing`` waits there for the fsyncs of the role's files that ran during the
CRCs (a tree before it fsyncs inside DCP's write), ``verified_read`` for the file check that ran during DCP's
read."""
_phase_s: dict[str, float] = {}
_installed: list[bool] = []


def _add(name: str, seconds: float) -> None:
    _phase_s[name] = _phase_s.get(name, 0.0) + seconds


def _timed(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(name, time.perf_counter() - t0)

    return wrapper


def _timed_exit(cm, name: str):
    @contextlib.contextmanager
    def wrapper(*args, **kwargs):
        body_done = 0.0
        try:
            with cm(*args, **kwargs):
                yield
                body_done = time.perf_counter()
        finally:
            if body_done:
                _add(name, time.perf_counter() - body_done)

    return wrapper


def install_phase_timers() -> None:
    """Wrap the functions of :data:`PHASES` so that their seconds add up per phase (once per process)."""
    if _installed:
        return
    _installed.append(True)
    for module, attr, name, how in PHASES:
        mod = importlib.import_module(module)
        if hasattr(mod, attr):
            setattr(mod, attr, (_timed if how == "call" else _timed_exit)(getattr(mod, attr), name))


def timed_phases(fn, *args) -> tuple[float, dict[str, float]]:
    """``fn(*args)`` (seconds) and the seconds of each phase it went through; ``rest``: the remainder."""
    _phase_s.clear()
    total = fn(*args)
    phases = dict(_phase_s)
    return total, phases | {"rest": total - sum(phases.values())}


def print_phases(phases: dict[str, list[dict[str, float]]], title: str = "") -> None:
    """Median seconds per phase (rows) and arm (columns)."""
    names = list(dict.fromkeys(n for rows in phases.values() for row in rows for n in row))
    names = [n for n in names if n != "rest"] + ["rest"]
    print(f"{title + 'phase (median s)':<26}" + "".join(f"{a:>15}" for a in ARMS))
    for n in names:
        cells = [statistics.median(row.get(n, 0.0) for row in phases[a]) for a in ARMS]
        print(f"{n:<26}" + "".join(f"{c:>15.3f}" for c in cells))


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


def overhead(secs: dict[str, float]) -> float:
    """Verified save + load over unverified save + load, minus one."""
    return (secs["save_verified"] + secs["load_verified"]) / (secs["save"] + secs["load"]) - 1


def against_baseline(args: argparse.Namespace) -> None:
    """Rounds of this script (``--rounds 1``) with the baseline's sources and with this tree's, their order
    alternating round by round."""
    from config_show import _export

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
    phases: dict[str, dict[str, list]] = {arm: {k: [] for k in ARMS} for arm in runs}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {"baseline": env | {"PYTHONPATH": _export(args.baseline, Path(tmp))}, "this tree": env}
        for r in range(args.rounds):
            for arm in ("baseline", "this tree") if r % 2 == 0 else ("this tree", "baseline"):
                out = Path(tmp) / "round.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--shape",
                    args.shape,
                    "--rounds",
                    "1",
                    "--dir",
                    str(args.dir),
                ]
                cmd += ["--json", str(out)] + (["--phases"] if args.phases else [])
                subprocess.run(cmd, env=envs[arm], check=True)
                result = json.loads(out.read_text())
                runs[arm].append(result["median_s"])
                for k, rows in result.get("phases_s", {}).items():
                    phases[arm][k] += rows
    print(f"{'arm':<10} " + " ".join(f"{k:>14}" for k in ARMS) + f" {'overhead':>9} {'of min':>9}")
    summary = {}
    for arm, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ARMS}
        low = {k: min(r[k] for r in rows) for k in ARMS}
        summary[arm] = {"median_s": med, "min_s": low, "save_load_overhead": overhead(med), "rounds": rows}
        line = " ".join(f"{med[k]:>14.3f}" for k in ARMS)
        print(f"{arm:<10} {line} {overhead(med):>+9.1%} {overhead(low):>+9.1%}")
    for arm in runs if args.phases else ():
        print_phases(phases[arm], f"{arm}: ")
        summary[arm]["phases_s"] = phases[arm]
    if args.json:
        args.json.write_text(
            json.dumps({"baseline": args.baseline, "shape": args.shape, **summary}, indent=1)
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["tiny", "small", "medium", "1.5b"], default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_verify_bench"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--baseline", default=None, help="commit whose verification runs alternately with this tree's"
    )
    ap.add_argument("--phases", action="store_true", help="also time each phase of the save and the load")
    ap.add_argument(
        "--load-schedules",
        type=int,
        default=0,
        metavar="N",
        help="then N rounds of loads of the last verified checkpoint per schedule of the load's file check",
    )
    args = ap.parse_args()
    if args.baseline:
        return against_baseline(args)
    SHAPES["small"], SHAPES["medium"] = SMALL, MEDIUM
    if args.phases:
        install_phase_timers()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, sched = build(args.shape, device)
    state = RoleState(model=model, optimizer=opt, lr_scheduler=sched)
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    times, phases = rounds(args, state)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    out = {
        "shape": args.shape,
        "device": str(device),
        "state_gb": nbytes / 1e9,
        "median_s": med,
        "min_s": low,
        "save_overhead": med["save_verified"] / med["save"] - 1,
        "load_overhead": med["load_verified"] / med["load"] - 1,
        "save_load_overhead": overhead(med),
        "save_load_overhead_of_min": overhead(low),
        "rounds": times,
    }
    if phases:
        print_phases(phases)
        out["phases_s"] = phases
    if args.load_schedules:
        role = args.dir / "verified" / f"global_step_{args.rounds}" / "actor"
        out["load_schedules"] = load_schedules(role, state, args.load_schedules)
    print(json.dumps({k: v for k, v in out.items() if k not in ("rounds", "phases_s")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


def load_schedules(role: Path, state: RoleState, n: int) -> dict[str, dict[str, float]]:
    """``n`` rounds of a load of ``role`` per schedule, the schedules' order alternating: unverified; verified
    as it is (the file check reads the segments in DCP's read order, without read-ahead hints); verified with
    ``POSIX_FADV_WILLNEED`` on each 16 MiB piece; verified in name order. Medians of the load's seconds and of
    DCP's read."""
    from posttrain.ckpt import verify

    install_phase_timers()
    real_crcs, real_order = verify.span_crcs, verify.dcp_read_order
    schedules = {
        "unverified": (False, real_crcs, real_order),
        "verified": (True, real_crcs, real_order),
        "WILLNEED": (True, functools.partial(real_crcs, read_ahead=True), real_order),
        "name order": (True, real_crcs, lambda _: {}),
    }
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in schedules}
    for r in range(n):
        for name in schedules if r % 2 == 0 else reversed(schedules):
            checked, verify.span_crcs, verify.dcp_read_order = schedules[name]
            try:
                total, split = timed_phases(load, role, state, checked)
            finally:
                verify.span_crcs, verify.dcp_read_order = real_crcs, real_order
            runs[name].append((total, split.get("dcp read", 0.0)))
    out = {
        k: {"load_s": statistics.median(t for t, _ in v), "dcp_read_s": statistics.median(d for _, d in v)}
        for k, v in runs.items()
    }
    for k, v in out.items():
        print(f"load schedule {k:<12} load {v['load_s']:8.3f} s   DCP read {v['dcp_read_s']:8.3f} s")
    return out


def rounds(
    args: argparse.Namespace, state: RoleState
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """``args.rounds`` rounds of a save and a load per arm, the arms' order alternating round by round (the
    disk's and the machine's drift, and whichever arm finds the other's pages cached, fall on both alike);
    seconds per arm and, with ``--phases``, seconds per phase."""
    times: dict[str, list[float]] = {k: [] for k in ARMS}
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in ARMS} if args.phases else {}
    shutil.rmtree(args.dir, ignore_errors=True)
    for r in range(args.rounds):
        for verify in (False, True) if r % 2 == 0 else (True, False):
            root = args.dir / ("verified" if verify else "plain")
            suffix = "_verified" if verify else ""
            role = root / f"global_step_{r + 1}" / "actor"
            for arm, fn, fn_args in (
                (f"save{suffix}", save, (root, state, r + 1, verify)),
                (f"load{suffix}", load, (role, state, verify)),
            ):
                total, split = timed_phases(fn, *fn_args)
                times[arm].append(total)
                if args.phases:
                    phases[arm].append(split)
        print({k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    return times, phases


if __name__ == "__main__":
    main()
