"""Checkpoint throughput: save/load GB/s of a model + AdamW state against a raw write/read of the same bytes.

Default: a Qwen2.5-1.5B-shaped model (1.54 B params, fp32 master weights + AdamW exp_avg/exp_avg_sq, about
18.5 GB) on one GPU, in one process. In the same call it measures

- raw write: the same bytes, already in host memory, written to one file in ``--dir`` with fsync (the disk's
  rate);
- raw read: that file read back after its pages were dropped from the page cache (``posix_fadvise``);
- sync save: ``CheckpointManager.stage`` + ``save_role`` + ``commit`` (D2H, DCP write, fsync, rename);
- load: ``load_role`` of model + optimizer + extra into the live model (page cache dropped first);
- the checkpoint's size on disk (the tied embedding is stored once, so it is about the state's size);
- ``prepare_role``: the pinned host buffers of the async snapshot allocated on a background thread, before the
  first async save, as a trainer does after its first step: ``prepare_s`` is the time until they are ready,
  and a stand-in for training (a loop of matrix products on the device, synchronised each iteration) runs on
  the main thread meanwhile: ``probe_prepare_max_ms`` / ``probe_prepare_mean_ms`` against ``probe_idle_*``
  show whether the allocation stalls the training thread or the device (``--no-prepare`` skips this);
- async save, twice: the time ``save_role`` blocks training (``async_first_blocking_s``: the first save, which
  allocates the pinned buffers itself with ``--no-prepare``; ``async_steady_blocking_s``: the second) and the
  time until the background write and commit are done.

Targets (issue 4): save >= 70% of the raw write rate; async blocking <= 1 s, the first save included.

The disk's rate drifts between runs (raw writes of 0.92 and 1.52 GB/s on two fresh GPU machines), so
``--repeats N`` alternates N (raw write, sync save) pairs and reports the ratio of the medians next to each
pair's ratio; ``--ratio-only`` stops there (no load, no async saves). ``--unstaged`` adds, to each round,
DCP's own save of the same state (its writer threads copy device tensors with ``.cpu()``): the sync save
before
:mod:`posttrain.ckpt.staging`, as a same-run baseline.

    python bench/ckpt_throughput.py [--dir /tmp/ckpt_bench] [--threads 8] [--json out.json] [--no-prepare]
    python bench/ckpt_throughput.py --repeats 3 --ratio-only [--unstaged]   # the save / raw-write ratio only
    python bench/ckpt_throughput.py --tiny          # CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.ckpt import CheckpointManager, RoleInfo, RoleState, load_role, prepare_role, save_role
from posttrain.core.config import CheckpointConfig

SHAPES = {
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 512,
        "tie_word_embeddings": True,
    },
}
CONTENTS = ["model", "optimizer", "extra"]


def build(shape: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """The model in fp32 on ``device`` with a populated AdamW state (one step on random gradients)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with device:
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint of model + optimizer holds."""
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drop_cache(path: Path) -> None:
    """Evict the (clean, fsynced) pages of every file under ``path`` from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write_read(tensors: list[torch.Tensor], target: Path, read: bool = True) -> tuple[float, float]:
    """Seconds to write the host copies of ``tensors`` to one file (fsync), and to read them back cold
    (``read=False``: no read, NaN)."""
    host = [t.cpu() for t in tensors]
    t0 = time.perf_counter()
    with open(target, "wb") as f:
        for t in host:
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    if not read:
        target.unlink()
        return write_s, float("nan")
    drop_cache(target)
    t0 = time.perf_counter()
    with open(target, "rb") as f:
        for t in host:
            f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    read_s = time.perf_counter() - t0
    target.unlink()
    return write_s, read_s


def save(mgr: CheckpointManager, state: RoleState, step: int, threads: int) -> float:
    """One save through the manager; with a writer, returns the seconds save_role blocked."""
    staging = mgr.stage(step)
    t0 = time.perf_counter()
    save_role(
        staging / "actor",
        state,
        RoleInfo(backend="torch", dcp_thread_count=threads),
        CONTENTS,
        step,
        writer=mgr.writer,
    )
    blocked = time.perf_counter() - t0
    mgr.commit(step)
    return blocked


def probe(device: torch.device, until: Any, min_iters: int = 20) -> dict[str, float]:
    """Time a stand-in training loop (matrix products, synchronised each iteration) until ``until()`` is
    true."""
    n = 4096 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    times = []
    while len(times) < min_iters or not until():
        t0 = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a)
        sync_device()
        times.append(time.perf_counter() - t0)
    return {"max_ms": max(times) * 1e3, "mean_ms": sum(times) / len(times) * 1e3, "iters": float(len(times))}


def prepare(amgr: CheckpointManager, state: RoleState, device: torch.device) -> tuple[dict[str, float], Any]:
    """prepare_role before the first async save, with the probe running on the main thread meanwhile; the
    results and the prepared buffers."""
    idle = probe(device, lambda: True)
    t0 = time.perf_counter()
    future = prepare_role("actor", state, CONTENTS, amgr.writer)
    during = probe(device, future.done, min_iters=1)
    res = {"prepare_s": time.perf_counter() - t0, "prepared_buffers": float(len(future.result()))}
    res |= {f"probe_idle_{k}": v for k, v in idle.items()}
    return res | {f"probe_prepare_{k}": v for k, v in during.items()}, future.result()


def unstaged_save(state: RoleState, target: Path, threads: int) -> None:
    """The baseline ``--unstaged`` times: DCP's own save of the same model + optimizer state (tied tensors
    once), whose writer threads copy each device tensor with ``.cpu()`` (the sync save before the staging
    pool)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        state.model, state.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    once: dict[int, tuple[str, torch.Tensor]] = {}  # a tied tensor under its first name only
    for name, tensor in msd.items():
        once.setdefault(tensor.data_ptr(), (name, tensor))
    msd = dict(once.values())
    dcp.save(
        {"model": msd, "optimizer": osd},
        storage_writer=dcp.FileSystemWriter(str(target), thread_count=threads),
        no_dist=True,
    )


def save_pairs(args: argparse.Namespace, state: RoleState, root: Path, nbytes: int) -> dict[str, Any]:
    """``args.repeats`` alternating (raw write, sync save[, unstaged save]) rounds; medians and per-round
    ratios."""
    raw, saved, unstaged, res = [], [], [], {}
    for i in range(args.repeats):  # alternating: disk drift hits both sides alike
        write_s, read_s = raw_write_read(
            state_tensors(state.model, state.optimizer), root / "raw.bin", read=i == 0
        )
        raw.append(nbytes / 1e9 / write_s)
        res.setdefault("raw_read_gbps", nbytes / 1e9 / read_s)
        shutil.rmtree(root / "sync", ignore_errors=True)
        mgr = CheckpointManager(root / "sync", CheckpointConfig(save_contents=CONTENTS, max_ckpt_to_keep=1))
        sync_device()
        t0 = time.perf_counter()
        save(mgr, state, 1, args.threads)
        saved.append(nbytes / 1e9 / (time.perf_counter() - t0))
        line = f"round {i}: raw write {raw[-1]:.3f} GB/s, save {saved[-1]:.3f} GB/s"
        if args.unstaged:
            t0 = time.perf_counter()
            unstaged_save(state, root / "unstaged", args.threads)
            unstaged.append(nbytes / 1e9 / (time.perf_counter() - t0))
            shutil.rmtree(root / "unstaged")
            line += f", unstaged DCP save {unstaged[-1]:.3f} GB/s"
        print(line, flush=True)
    res |= {"raw_write_gbps": statistics.median(raw), "save_gbps": statistics.median(saved)}
    res["save_s"] = nbytes / 1e9 / res["save_gbps"]
    res["save_vs_raw_write"] = res["save_gbps"] / res["raw_write_gbps"]
    if args.repeats > 1:
        res["pairs_raw_write_gbps"] = [round(r, 3) for r in raw]
        res["pairs_save_vs_raw"] = [round(b / a, 3) for a, b in zip(raw, saved)]
    if unstaged:
        res["unstaged_save_gbps"] = statistics.median(unstaged)
        res["unstaged_vs_raw_write"] = res["unstaged_save_gbps"] / res["raw_write_gbps"]
        res["pairs_unstaged_vs_raw"] = [round(b / a, 3) for a, b in zip(raw, unstaged)]
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    model, opt, sched = build("tiny" if args.tiny else "1.5b", device)
    state = RoleState(model=model, optimizer=opt, lr_scheduler=sched, counters={"global_step": 0})
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, opt))
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    res: dict[str, Any] = {"state_gb": nbytes / 1e9, "device": device.type}
    res |= save_pairs(args, state, root, nbytes)
    res["ckpt_files_gb"] = sum(p.stat().st_size for p in (root / "sync").rglob("*") if p.is_file()) / 1e9
    if args.ratio_only:
        shutil.rmtree(root, ignore_errors=True)
        return res
    drop_cache(root / "sync")
    t0 = time.perf_counter()
    load_role(root / "sync" / "global_step_1" / "actor", state, CONTENTS)
    sync_device()
    res["load_s"] = time.perf_counter() - t0
    res["load_gbps"] = nbytes / 1e9 / res["load_s"]
    shutil.rmtree(root / "sync")

    amgr = CheckpointManager(
        root / "async", CheckpointConfig(save_contents=CONTENTS, async_save=True, max_ckpt_to_keep=1)
    )
    prepared: dict[str, Any] = {}
    if not args.no_prepare:
        prep_res, prepared = prepare(amgr, state, device)
        res |= prep_res
    for i, key in ((1, "async_first"), (2, "async_steady")):
        t0 = time.perf_counter()
        res[f"{key}_blocking_s"] = save(amgr, state, i, args.threads)
        amgr.wait()
        res[f"{key}_total_s"] = time.perf_counter() - t0
    if prepared:  # fraction of the prepared buffers the snapshots used (1.0: none allocated again)
        bufs = amgr.writer.host_buffers
        res["prepared_reused"] = sum(bufs.get(k) is v for k, v in prepared.items()) / len(prepared)
    amgr.close()
    res["load_vs_raw_read"] = res["load_gbps"] / res["raw_read_gbps"]
    shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke run)")
    parser.add_argument("--dir", default="/tmp/ckpt_bench", help="scratch directory on the disk under test")
    parser.add_argument("--threads", type=int, default=8, help="DCP writer threads")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--no-prepare",
        action="store_true",
        help="no prepare_role: the first async save allocates its buffers",
    )
    parser.add_argument("--repeats", type=int, default=1, help="alternating (raw write, save) pairs")
    parser.add_argument("--ratio-only", action="store_true", help="stop after the save / raw-write pairs")
    parser.add_argument(
        "--unstaged", action="store_true", help="also time DCP's own save (no staging pool) in each round"
    )
    args = parser.parse_args()
    res = run(args)
    for k, v in res.items():
        print(f"{k:>28}: {v:.3f}" if isinstance(v, float) else f"{k:>28}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
