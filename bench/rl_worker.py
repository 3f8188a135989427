"""The process side of ``bench/rl_throughput.py``: :func:`launch` runs a script's ``--worker SPEC`` as a
subprocess (``python`` or ``torchrun``, in its own process group, killed at the timeout) and collects each
rank's result;
:func:`worker` is that subprocess for a posttrain run: it builds the trainer from the spec's presets and
overrides and times its steps, with the device memory peak (:class:`MemoryPeak`) and Python's GC time
(:class:`GcClock`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

RL_THROUGHPUT = str(Path(__file__).with_name("rl_throughput.py"))
"""The script whose ``--worker`` runs a posttrain spec."""


class MemoryPeak:
    """The highest device memory in use (NVML, so vLLM's pool counts) seen every 50 ms, on a thread."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device, self.peak = torch, device, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.on = device.type == "cuda"
        if self.on:
            try:  # NVML (nvidia-ml-py) is a measurement here: without it the run still counts, unpeaked
                self.peak = torch.cuda.device_memory_used(device)
            except Exception as exc:  # noqa: BLE001
                print(
                    f"[rl-bench] no device memory reading ({exc}): peak_device_gib is null", file=sys.stderr
                )
                self.on = False
        if self.on:
            self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.torch.cuda.device_memory_used(self.device))

    def close(self) -> float | None:
        self.stop.set()
        if not self.on:
            return None
        self.thread.join()
        return round(self.peak / 2**30, 2)


class GcClock:
    """Seconds Python's cyclic garbage collector ran, and its full (generation 2) collections, since
    :meth:`reset` (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        import gc

        self.gc, self.t0, self.seconds, self.full = gc, 0.0, 0.0, 0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self.t0
        self.full += info.get("generation") == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0

    def read(self) -> dict[str, float]:
        return {
            "gc_s": round(self.seconds, 3),
            "gc_full": self.full,
            "gc_tracked": len(self.gc.get_objects()),
        }

    def close(self) -> None:
        self.gc.callbacks.remove(self._tick)


def worker(spec_path: str) -> None:
    """Run one spec's steps in this process (one rank of it under torchrun) and write this rank's result."""
    import torch

    from posttrain.trainers.config import load_config
    from posttrain.trainers.rl.trainer import RLTrainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config(spec["overrides"], spec["presets"])
    start = time.perf_counter()
    trainer = RLTrainer(cfg)
    init_s = time.perf_counter() - start
    device = torch.device(trainer.actor.device) if trainer.actor.device is not None else torch.device("cpu")
    steps: list[dict[str, float]] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = MemoryPeak(device)  # over every step, warm-up included, as bench/trl_grpo.py measures TRL
    gc_clock = GcClock()
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        gc_clock.reset()
        metrics = trainer.train_step()
        wall = time.perf_counter() - t0
        trainer.global_step += 1
        trainer.tracker.log(metrics, trainer.global_step)
        steps.append({**metrics, "wall_s": wall, "warmup": i < spec["warmup"], **gc_clock.read()})
    gc_clock.close()
    rank = int(os.environ.get("RANK", "0"))
    result = {
        "rank": rank,
        "init_s": init_s,
        "steps": steps,
        "peak_device_gib": peak.close(),
        "peak_torch_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    trainer.close()
    Path(spec["result"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))


def launch(
    spec: dict[str, Any], launcher: str, world: int, run_dir: Path, timeout: int, script: str = RL_THROUGHPUT
) -> list[dict] | str:
    """Run ``script --worker SPEC`` as a subprocess; the ranks' results, or the error with the log's tail."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("result.rank*.json"):
        old.unlink()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "result": str(run_dir / "result.json")}))
    worker_argv = [str(Path(script).resolve()), "--worker", str(spec_path)]
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            *worker_argv,
        ]
    else:
        cmd = [sys.executable, *worker_argv]
    log = run_dir / "log.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, process_group=0)
        stop_run = lambda *_: (os.killpg(proc.pid, signal.SIGKILL), sys.exit(143))  # noqa: E731
        previous = signal.signal(signal.SIGTERM, stop_run)  # `timeout` stops this launcher: stop the run too
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # torchrun's workers too: the run has its own process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"timeout after {timeout}s"
        finally:
            signal.signal(signal.SIGTERM, previous)
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result.rank*.json"))]
    if rc != 0 or not results:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        return f"exit {rc}; log {log}:\n" + "\n".join(tail)
    return sorted(results, key=lambda r: r["rank"])
