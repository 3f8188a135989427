"""torch's CPU thread count for a single training process on a CPU.

torch starts one intra-op thread per core. On a machine whose cores other processes are using (a shared
developer box, a CI runner), those threads spin-wait on each other and a step takes several times longer than
with fewer threads (BENCHMARKS.md, ``bench/cpu_threads.py``). :func:`configure` therefore sets the count, for a
single process without CUDA, to the cores this process may run on (``os.sched_getaffinity``) that the 1-minute
load average leaves free, at least one, and says so on stderr. It leaves torch as it is when ``OMP_NUM_THREADS``
is set (the user chose), under torchrun (``WORLD_SIZE`` > 1: the launcher sets ``OMP_NUM_THREADS``) and when
CUDA is available (the CPU threads do not run the model).
"""

from __future__ import annotations

import math
import os
import sys

import torch


def cpu_threads(cores: int, load: float) -> int:
    """Threads for ``cores`` usable cores of which other processes keep ``load`` busy: the free ones, >= 1."""
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def configure() -> int | None:
    """Set torch's thread count as the module docstring says; return it, or None when left as it was."""
    if os.environ.get("OMP_NUM_THREADS") or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    if torch.cuda.is_available():
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
