"""Checkpoint retention: keep the newest N step directories of a root and delete the older ones.

One rule for the step manager (:class:`~posttrain.ckpt.CheckpointManager`, after each commit) and for an
engine that saves straight into ``<root>/global_step_<N>/<role>`` (both engines' ``save_checkpoint(...,
max_ckpt_to_keep=...)``, through :func:`retain_role_saves`). :func:`retain` runs only once the new checkpoint
is complete, so a crash while saving never costs the last good one. Each directory to delete is first renamed
to ``.tmp.old.global_step_<M>`` (one atomic rename), so a crash while deleting leaves hidden debris, never a
half-deleted directory under a checkpoint's name; the debris of older saves and deletions goes on the way.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import dist as ckpt_dist
from .layout import complete_steps, fsync_path, parse_step

DEBRIS_PREFIXES = (".tmp.old.", ".tmp.")
"""Hidden names of a save in progress (``.tmp.global_step_<N>``) and of a directory being replaced or
deleted."""


def step_dirs(root: str | Path) -> dict[int, Path]:
    """Every ``global_step_<N>`` directory under ``root`` by step, complete or not."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir():
            found[step] = child
    return found


def _debris_step(name: str) -> int | None:
    for prefix in DEBRIS_PREFIXES:
        if name.startswith(prefix):
            return parse_step(name.removeprefix(prefix))
    return None


def remove(root: Path, step_dir: Path) -> None:
    """Delete ``step_dir`` (a child of ``root``): renamed to its hidden debris name first, then removed."""
    trash = root / f"{DEBRIS_PREFIXES[0]}{step_dir.name}"
    shutil.rmtree(trash, ignore_errors=True)
    step_dir.replace(trash)
    fsync_path(root)
    shutil.rmtree(trash)


def retain(
    root: str | Path, keep: int | None, current: int, steps: Mapping[int, Path] | None = None
) -> list[int]:
    """Keep ``current`` and the newest ``keep - 1`` other checkpoints of ``root``; delete the rest of
    ``steps`` (default: the complete step directories, :func:`~posttrain.ckpt.layout.complete_steps`), and the
    debris of saves of older steps. ``keep=None`` keeps every checkpoint. Call it only once ``current`` is
    complete and in place. Returns the deleted steps, newest first."""
    root = Path(root)
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint.max_ckpt_to_keep={keep} must be >= 1 or null (keep all)")
    for child in list(root.iterdir()):
        old = _debris_step(child.name)
        if old is not None and old < current:
            shutil.rmtree(child, ignore_errors=True)
    if keep is None:
        return []
    steps = complete_steps(root) if steps is None else steps
    doomed = sorted((s for s in steps if s != current), reverse=True)[keep - 1 :]
    for step in doomed:
        remove(root, steps[step])
    return doomed


def retain_role_saves(
    role_dir: str | Path, keep: int | None, finished: Callable[[Path], bool], writer: Any = None
) -> None:
    """An engine's ``save_checkpoint(<root>/global_step_<N>/<role>, max_ckpt_to_keep=keep)``: keep the newest
    ``keep`` saves of this role among the ``global_step_<N>`` siblings of its step directory, counting only
    those whose role directory is ``finished`` (its last file written), once this save is written: behind it
    on ``writer`` (an :class:`~posttrain.ckpt.AsyncWriter`) for an async save. A role directory whose parent
    is not named ``global_step_<N>`` (a step manager's staging directory) leaves retention to the manager.
    Call it on every rank; rank 0 deletes."""
    role_dir = Path(role_dir)
    step_dir = role_dir.parent
    current = parse_step(step_dir.name)
    if keep is None or current is None or ckpt_dist.get_rank() != 0:
        return

    def job() -> None:
        done = {s: d for s, d in step_dirs(step_dir.parent).items() if finished(d / role_dir.name)}
        retain(step_dir.parent, keep, current, {**done, current: step_dir})

    if writer is not None:
        writer.submit(job)
    else:
        job()
