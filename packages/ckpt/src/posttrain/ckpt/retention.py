"""Checkpoint retention: keep the newest N step directories of a root and delete the older ones.

One rule for the step manager (:class:`~posttrain.ckpt.CheckpointManager`, after each commit) and for an engine
that saves straight into ``<root>/global_step_<N>/<role>`` (the megatron engine's ``save_checkpoint(...,
max_ckpt_to_keep=...)``). :func:`retain` runs only once the new checkpoint is complete, so a crash while saving
never costs the last good one. Each directory to delete is first renamed to ``.tmp.old.global_step_<M>`` (one
atomic rename), so a crash while deleting leaves hidden debris, never a half-deleted directory under a
checkpoint's name; the debris of older saves and deletions goes on the way.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from .layout import complete_steps, fsync_path, parse_step

DEBRIS_PREFIXES = (".tmp.old.", ".tmp.")
"""Hidden names of a save in progress (``.tmp.global_step_<N>``) and of a directory being replaced or deleted."""


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
    """Keep ``current`` and the newest ``keep - 1`` other checkpoints of ``root``; delete the rest of ``steps``
    (default: the complete step directories, :func:`~posttrain.ckpt.layout.complete_steps`), and the debris of
    saves of older steps. ``keep=None`` keeps every checkpoint. Call it only once ``current`` is complete and in
    place. Returns the deleted steps, newest first."""
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
