"""The ``extra`` checkpoint item: LR scheduler state, RNG states and step counters, one file per rank.

RNG states are per rank (python ``random``, numpy's global generator, torch CPU and every CUDA device when
CUDA is initialised). They are stored as plain tensors and tuples so the file loads with
``weights_only=True``.
Resuming on a different world size restores rank r's RNG from rank r's file when it exists and warns
otherwise.
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """Snapshot of every RNG this process draws from."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every RNG back to ``state`` (from :func:`capture_rng`)."""
    random.setstate(_as_tuple(state["python"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint has CUDA RNG states for {len(state['cuda'])} devices, this process sees "
                f"{torch.cuda.device_count()}: CUDA RNG left as is",
                stacklevel=2,
            )
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(obj: Any) -> Any:
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def capture_extra(lr_scheduler: Any | None, counters: dict[str, Any]) -> dict[str, Any]:
    """The extra item of one rank: scheduler state (or None), RNG states and counters."""
    return {
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "rng": capture_rng(),
        "counters": dict(counters),
    }


def extra_path(extra_dir: Path, rank: int) -> Path:
    """File of ``rank``'s extra state."""
    return extra_dir / f"rank_{rank}.pt"


def save_extra(extra_dir: Path, rank: int, extra: dict[str, Any]) -> None:
    """Write (and fsync) one rank's extra state."""
    extra_dir.mkdir(parents=True, exist_ok=True)
    path = extra_path(extra_dir, rank)
    with open(path, "wb") as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())


def load_extra(extra_dir: Path, rank: int, lr_scheduler: Any | None) -> dict[str, Any]:
    """Restore the scheduler and this rank's RNG; return the counters.

    The scheduler state and counters are the same on every rank, so a rank without its own file (more ranks
    than at save time) takes rank 0's and keeps its RNG as is, with a warning.
    """
    own = extra_path(extra_dir, rank)
    path = own if own.is_file() else extra_path(extra_dir, 0)
    if not path.is_file():
        raise ValueError(
            f"no extra state in {extra_dir}: the checkpoint was saved without extra; remove extra "
            "from checkpoint.load_contents"
        )
    extra = torch.load(path, weights_only=True)
    if lr_scheduler is not None and extra["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if path == own:
        restore_rng(extra["rng"])
    else:
        warnings.warn(
            f"no RNG state for rank {rank} in {extra_dir} (saved on fewer ranks): RNG left as is",
            stacklevel=2,
        )
    return extra["counters"]
