"""Where a trainer resumes from: ``trainer.resume_mode`` = auto | disable | resume_path.

``auto`` takes the newest complete checkpoint under ``trainer.default_local_dir`` (none: start fresh);
``resume_path`` takes ``trainer.resume_from_path``, which must be a complete ``global_step_<N>`` directory (the
step comes from that directory's own name, never from a parent's); ``disable`` always starts fresh.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.ckpt import find_latest, is_complete
from posttrain.ckpt.layout import parse_step

if TYPE_CHECKING:
    from .trainer_config import TrainerConfig


def resume_point(cfg: TrainerConfig) -> tuple[int, Path] | None:
    """(step, step directory) to resume from, or None to start at step 0."""
    if cfg.resume_mode == "disable":
        return None
    if cfg.resume_mode == "auto":
        return find_latest(cfg.default_local_dir)
    path = Path(str(cfg.resume_from_path))
    step = parse_step(path.name)
    if step is None or not path.is_dir():
        raise ValueError(
            f"trainer.resume_from_path={str(path)!r} is not a global_step_<N> directory: point it at "
            "one, e.g. .../global_step_100"
        )
    if not is_complete(path):
        raise ValueError(
            f"trainer.resume_from_path={str(path)!r} is an incomplete checkpoint (no readable "
            "checkpoint.json or a role without manifest.json): choose a complete one"
        )
    return step, path
