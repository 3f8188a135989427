"""Where a trainer resumes from: ``trainer.resume_mode`` = auto | disable | resume_path.

``auto`` takes the newest checkpoint under ``trainer.default_local_dir`` whose files all match the checksums
its save recorded (:func:`posttrain.ckpt.find_intact`; a newer damaged or incomplete step is named in a
warning and skipped; none: start fresh); ``resume_path`` takes ``trainer.resume_from_path``, which must be an
intact ``global_step_<N>`` directory (the step comes from that directory's own name, never from a parent's): a
damaged one is refused with what is wrong and the newest intact step to use instead; ``disable`` always starts
fresh.
Both verify on every rank (collective), each rank reading its share of the files.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.ckpt import find_intact, verify_step
from posttrain.ckpt.layout import parse_step

if TYPE_CHECKING:
    from .trainer_config import TrainerConfig


def resume_point(cfg: TrainerConfig) -> tuple[int, Path] | None:
    """(step, step directory) to resume from, or None to start at step 0."""
    if cfg.resume_mode == "disable":
        return None
    if cfg.resume_mode == "auto":
        return find_intact(cfg.default_local_dir)
    path = Path(str(cfg.resume_from_path))
    step = parse_step(path.name)
    if step is None or not path.is_dir():
        raise ValueError(
            f"trainer.resume_from_path={str(path)!r} is not a global_step_<N> directory: point it at "
            "one, e.g. .../global_step_100"
        )
    problems = verify_step(path)
    if problems:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            intact = find_intact(path.parent)
        use = (
            f"trainer.resume_from_path={intact[1]}"
            if intact
            else "trainer.resume_mode=disable (none is intact)"
        )
        raise ValueError(
            f"trainer.resume_from_path={str(path)!r} is damaged or incomplete:\n  "
            + "\n  ".join(problems[:8])
            + f"\nresume from the newest intact step instead: {use}"
        )
    return step, path
