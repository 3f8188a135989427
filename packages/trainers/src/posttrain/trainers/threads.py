"""torch's CPU thread count for a single training process on a CPU.

torch starts one intra-op thread per core. On a machine whose cores other processes are using (a shared
developer box, a CI runner), those threads spin-wait on each other and a step takes several times longer than
with fewer threads (BENCHMARKS.md, ``bench/cpu_threads.py``). :func:`configure` therefore sets the count, for
a single process without CUDA, to the cores this process may run on (``os.sched_getaffinity``) that the
1-minute load average leaves free, at least one, and says so on stderr. It leaves torch as it is when
``OMP_NUM_THREADS`` is set (the user chose), under torchrun (``WORLD_SIZE`` > 1: the launcher sets
``OMP_NUM_THREADS``) and when CUDA is available (the CPU threads do not run the model).

A checkpoint records the count its run trained with, and :func:`keep` sets it again on resume (under the same
three exceptions), so a resumed CPU run repeats the uninterrupted one bitwise even when the load has changed
since: a different count changes the order of float sums (a run on 2 threads and its resume on 1 differed in
the last bit of a gradient norm).
"""

from __future__ import annotations

import math
import os
import sys

import torch


def cpu_threads(cores: int, load: float) -> int:
    """Threads for ``cores`` usable cores of which other processes keep ``load`` busy: the free ones, >= 1."""
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def _ours() -> bool:
    """Whether posttrain picks the count: not when ``OMP_NUM_THREADS`` is set, under torchrun, or with
    CUDA."""
    if os.environ.get("OMP_NUM_THREADS") or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False
    return not torch.cuda.is_available()


def configure() -> int | None:
    """Set torch's thread count as the module docstring says; return it, or None when left as it was."""
    if not _ours():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = cpu_threads(cores, load)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    print(
        f"torch CPU threads: {n} ({cores} cores usable by this process, 1-min load {load:.1f} from other "
        "processes; set OMP_NUM_THREADS=N to choose)",
        file=sys.stderr,
    )
    return n


def keep(saved: int | None) -> int | None:
    """On resume, set the count the checkpoint recorded (``saved``; None: a checkpoint from before it was
    recorded) where :func:`configure` would choose; return the count set, or None when left as it was."""
    if saved is None or not _ours() or saved == torch.get_num_threads():
        return None
    torch.set_num_threads(saved)
    print(
        f"torch CPU threads: {saved}, as the checkpoint's run trained with (a resumed run repeats it bitwise "
        "only on the same count; set OMP_NUM_THREADS=N to choose)",
        file=sys.stderr,
    )
    return saved
