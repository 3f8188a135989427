"""Step-level checkpoint manager: stage, commit atomically, find the newest complete checkpoint, retain N.

A save of step N goes: ``stage(N)`` creates ``<root>/.tmp.global_step_N`` (rank 0, then a barrier); every role
and the trainer write into it; ``commit(N)`` waits for every rank (barrier), then rank 0 writes
``checkpoint.json``, fsyncs the whole tree, renames it to ``global_step_N`` in one ``os.replace``, fsyncs the
root, and only then rewrites ``latest_checkpointed_iteration.txt`` atomically; retention
(:func:`~posttrain.ckpt.retention.retain`) runs last, so old checkpoints are deleted only after the new one is
in place. A crash before the rename leaves only a staging
directory (ignored); a crash after it but before the tracker update leaves the tracker on the previous
checkpoint, which :meth:`latest` returns. With ``async_save`` the commit is queued on the background writer
behind the role writes, and the next :meth:`stage` waits for it.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.config import CheckpointConfig

from . import dist as ckpt_dist
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    ROLE_MANIFEST,
    STEP_MANIFEST,
    TRACKER,
    TRAINER_STATE,
    atomic_write_text,
    complete_steps,
    fsync_path,
    fsync_tree,
    is_complete,
    parse_step,
    read_json,
    staging_dir_name,
    step_dir_name,
    write_json,
)
from .retention import retain
from .verify import CheckpointCorruptError, check_file, file_record, raise_if, verify_step
from .writer import AsyncWriter


class CheckpointManager:
    """Crash-safe step checkpoints under ``root_dir`` (the trainer's ``default_local_dir``).

    Every rank constructs the manager and calls :meth:`stage` and :meth:`commit` (they hold barriers when
    torch.distributed is initialised); only rank 0 writes the shared files. The root must be visible to all
    ranks.
    """

    def __init__(self, root_dir: str | Path, config: CheckpointConfig) -> None:
        self.root = Path(root_dir)
        self.config = config
        self.rank = ckpt_dist.get_rank()
        self.world_size = ckpt_dist.get_world_size()
        self.writer: AsyncWriter | None = None
        """Background writer when ``config.async_save``; pass it to the engines'
        ``save_checkpoint(writer=...)``."""
        if config.async_save:
            group = dist.new_group(backend="gloo") if ckpt_dist.is_initialized() else None
            self.writer = AsyncWriter(process_group=group)

    # ------------------------------------------------------------------ paths
    def step_dir(self, step: int) -> Path:
        """Final directory of ``step``."""
        return self.root / step_dir_name(step)

    def staging_dir(self, step: int) -> Path:
        """Staging directory of ``step``."""
        return self.root / staging_dir_name(step)

    # ------------------------------------------------------------------ save
    def stage(self, step: int) -> Path:
        """Wait for any previous async save, create an empty staging directory for ``step`` and return it."""
        self.wait()
        staging = self.staging_dir(step)
        if self.rank == 0:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        ckpt_dist.barrier()
        return staging

    def save_trainer_state(self, step: int, state: dict[str, Any], per_rank: bool = False) -> None:
        """Write trainer state (dataloader position, counters) into the staging directory of ``step``.

        ``per_rank=False``: rank 0 writes ``data.pt``; ``per_rank=True``: every rank writes
        ``data_rank_<r>.pt``.
        """
        staging = self.staging_dir(step)
        if not staging.is_dir():
            raise ValueError(f"no staging directory for step {step} at {staging}: call stage({step}) first")
        if per_rank:
            torch.save(state, staging / f"data_rank_{self.rank}.pt")
        elif self.rank == 0:
            torch.save(state, staging / TRAINER_STATE)

    def commit(self, step: int) -> None:
        """Make the staged step the latest checkpoint (queued behind the role writes when async)."""
        if not self.staging_dir(step).is_dir():
            raise ValueError(
                f"no staging directory for step {step} at {self.staging_dir(step)}: call "
                f"stage({step}) and save into it before commit({step})"
            )
        if self.writer is not None:
            self.writer.submit(self._commit, step, self.writer.process_group)
        else:
            self._commit(step, None)

    def wait(self) -> None:
        """Block until a queued async save (writes and commit) has finished; re-raise its error."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """Finish pending saves and stop the background writer."""
        if self.writer is not None:
            self.writer.close()

    def _commit(self, step: int, group: dist.ProcessGroup | None) -> None:
        ckpt_dist.barrier(group)
        if self.rank == 0:
            self._publish(step)
        ckpt_dist.barrier(group)

    def _publish(self, step: int) -> None:
        staging, final = self.staging_dir(step), self.step_dir(step)
        roles = sorted(d.name for d in staging.iterdir() if (d / ROLE_MANIFEST).is_file())
        files = sorted(p.name for p in staging.iterdir() if p.is_file())
        write_json(
            staging / STEP_MANIFEST,
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "global_step": step,
                "roles": roles,
                "world_size": self.world_size,
                "files": files,
                "checksums": {name: file_record(staging / name, []) for name in files},
                "created_unix": time.time(),
            },
        )
        fsync_tree(staging)
        if final.exists():  # an earlier save of the same step (e.g. re-run after a resume): replace it
            old = self.root / f".tmp.old.{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            final.replace(old)
            staging.replace(final)
            shutil.rmtree(old)
        else:
            staging.replace(final)
        fsync_path(self.root)
        atomic_write_text(self.root / TRACKER, f"{step}\n")
        retain(self.root, self.config.max_ckpt_to_keep, step)

    # ------------------------------------------------------------------ resume
    def latest(self) -> tuple[int, Path] | None:
        """The newest committed, complete checkpoint as ``(step, path)``, or None.

        The tracker file names the committed step; when it is missing, unreadable or names a directory that is
        not complete, the newest complete ``global_step_<N>`` directory is used. The step always comes from
        the directory's own name.
        """
        return find_latest(self.root)


def find_latest(root: str | Path) -> tuple[int, Path] | None:
    """:meth:`CheckpointManager.latest` for a root directory, without a manager. A ``global_step_<N>``
    directory newer than the one returned that is not complete (its ``checkpoint.json`` or a role's
    ``manifest.json`` is missing: committed directories always have them) is named in a warning."""
    root = Path(root)
    found = _find_latest(root)
    newest = found[0] if found is not None else -1
    for step, path in sorted(_step_dirs(root).items(), reverse=True):
        if step > newest and not is_complete(path):
            warnings.warn(
                f"skipped checkpoint {path}: incomplete (no readable {STEP_MANIFEST} or a role without "
                f"{ROLE_MANIFEST}; a committed step always has both, so a file was deleted or lost)",
                stacklevel=2,
            )
    return found


def _step_dirs(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {s: p for p in root.iterdir() if (s := parse_step(p.name)) is not None and p.is_dir()}


def _find_latest(root: Path) -> tuple[int, Path] | None:
    try:
        tracked = int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        tracked = None
    if tracked is not None and tracked >= 0:
        path = root / step_dir_name(tracked)
        if is_complete(path):
            return parse_step(path.name), path
    steps = complete_steps(root)
    if not steps:
        return None
    newest = max(steps)
    return newest, steps[newest]


def find_intact(root: str | Path, verify: bool = True) -> tuple[int, Path] | None:
    """The newest ``global_step_<N>`` under ``root`` that passes :func:`~posttrain.ckpt.verify.verify_step`
    (every file against its checksums; collective: call on every rank), or None. Each newer step it passes
    over is named in one warning with what is wrong with it. ``verify=False`` is :func:`find_latest`."""
    root = Path(root)
    if not verify:
        return find_latest(root)
    skipped = []
    for step, path in sorted(_step_dirs(root).items(), reverse=True):
        problems = verify_step(path)
        if not problems:
            if skipped:
                warnings.warn(
                    f"resuming from {path}, the newest intact checkpoint; skipped " + "; ".join(skipped),
                    stacklevel=2,
                )
            return step, path
        skipped.append(f"{path.name} ({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})")
    if skipped:
        warnings.warn(
            f"no intact checkpoint under {root}, starting fresh; skipped " + "; ".join(skipped), stacklevel=2
        )
    return None


def load_trainer_state(step_dir: str | Path, rank: int | None = None) -> dict[str, Any]:
    """Read the trainer state written by :meth:`CheckpointManager.save_trainer_state`, checked against the
    checksum ``checkpoint.json`` recorded for it (:class:`~posttrain.ckpt.verify.CheckpointCorruptError`)."""
    step_dir = Path(step_dir)
    name = TRAINER_STATE if rank is None else f"data_rank_{rank}.pt"
    path = step_dir / name
    manifest = read_json(step_dir / STEP_MANIFEST) or {}
    record = manifest.get("checksums", {}).get(name)
    if record is not None:
        raise_if(check_file(step_dir, name, record), f"trainer state of {step_dir}")
    elif name not in manifest.get("files", [name]) or not path.is_file():
        raise ValueError(
            f"no trainer state at {path}: the checkpoint was saved without it (per_rank="
            f"{rank is not None}); load without trainer state or pass the matching rank"
        )
    if not path.is_file():
        raise CheckpointCorruptError(
            f"{path} is missing although {step_dir / STEP_MANIFEST} lists it: it was saved, then deleted or "
            f"lost; resume from another step (trainer.resume_from_path=<root>/global_step_<M>)"
        )
    return torch.load(path, weights_only=True)
