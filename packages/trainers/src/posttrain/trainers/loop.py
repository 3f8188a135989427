"""The step loop the SFT and RL trainers share: validation and checkpoint cadence, logging, teardown.

At the start of ``fit()`` rank 0 writes the resolved config and the installed versions to
``<trainer.default_local_dir>/config.yaml`` (:mod:`.run_record`). A trainer provides ``train_step()``,
``validate()`` and ``save_checkpoint(step)`` and the attributes set in its constructor (``cfg``, ``tracker``,
``ckpt``, ``global_step``, ``total_steps``, ``val_set``, ``owns_group``).
Validation runs every ``trainer.test_freq`` steps and after the last one (and before the first with
``trainer.val_before_train``); checkpoints every ``trainer.save_freq`` steps and after the last one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.core.config.loader import to_dict

from . import distributed as pdist
from .logging import Tracker
from .run_record import write_run_record


class StepLoop:
    """``fit()`` and ``close()`` over a trainer's own step, validation and checkpoint methods."""

    cfg: Any
    tracker: Any
    ckpt: Any
    global_step: int
    total_steps: int
    val_set: Any
    owns_group: bool
    command: str = "sft"
    """The ``posttrain`` subcommand that reruns this trainer's ``config.yaml``."""

    def train_step(self) -> dict[str, float]:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    def save_checkpoint(self, step: int) -> Any:
        raise NotImplementedError

    def make_tracker(self) -> Tracker:
        """The loggers of ``trainer.logger`` (rank 0 only), continuing at ``global_step`` after a resume."""
        cfg = self.cfg.trainer
        return Tracker(
            cfg.logger,
            local_dir=cfg.default_local_dir,
            project=cfg.project_name,
            experiment=cfg.experiment_name,
            config=to_dict(self.cfg),
            total_steps=self.total_steps,
            resume_step=self.global_step,
            enabled=pdist.rank() == 0,
        )

    def prepare_checkpoints(self) -> None:
        """Let each role's engine pin its async-save buffers in the background (after the first step)."""

    def release(self) -> None:
        """Free what the trainer holds besides checkpoints and loggers (e.g. a rollout engine)."""

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``; return the last step's metrics (with val/* when validated)."""
        cfg = self.cfg.trainer
        if pdist.rank() == 0:
            write_run_record(self.cfg, cfg.default_local_dir, self.command)
        metrics: dict[str, float] = {}
        if self.val_set is not None and cfg.val_before_train and self.global_step == 0:
            self.tracker.log(self.validate(), 0)
        first = True
        while self.global_step < self.total_steps:
            metrics = self.train_step()
            self.global_step += 1
            if first and self.ckpt.writer is not None:  # optimizer state exists now: shapes are known
                self.prepare_checkpoints()
            first = False
            last = self.global_step == self.total_steps
            if self.val_set is not None and (
                last or (cfg.test_freq > 0 and self.global_step % cfg.test_freq == 0)
            ):
                metrics.update(self.validate())
            if last or (cfg.save_freq > 0 and self.global_step % cfg.save_freq == 0):
                self.save_checkpoint(self.global_step)
            self.tracker.log(metrics, self.global_step)
        return metrics

    def close(self) -> Path | None:
        """Wait for checkpoints, release resources, close loggers; return the curves PNG if one was drawn."""
        self.ckpt.close()
        self.release()
        png = self.tracker.finish()
        # vLLM's external_launcher tears the default group down itself when its engine shuts down (release
        # above).
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return png
