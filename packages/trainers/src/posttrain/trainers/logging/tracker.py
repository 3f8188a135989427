"""Tracker: one object the trainers log through, fanning out to the backends in ``trainer.logger``.

Only the rank that owns outputs (rank 0) creates backends; on other ranks every call is a no-op, so trainer
code logs unconditionally. ``finish()`` closes the backends and, when ``file`` is selected, draws
``metrics.png`` next to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .backends import METRICS_FILE, FileLogger, MlflowLogger, TensorboardLogger, WandbLogger
from .plot import plot_metrics
from .progress import ConsoleLogger


class Tracker:
    """Log ``{namespace/key: value}`` dicts per step to every selected backend."""

    def __init__(
        self,
        backends: Sequence[str],
        *,
        local_dir: str | Path,
        project: str = "posttrain",
        experiment: str = "run",
        config: dict[str, Any] | None = None,
        total_steps: int = 0,
        resume_step: int = 0,
        enabled: bool = True,
    ) -> None:
        self.local_dir = Path(local_dir)
        self.backends: dict[str, Any] = {}
        if not enabled:
            return
        config = config or {}
        makers = {
            "console": lambda: ConsoleLogger(total_steps, resume_step, desc=experiment),
            "file": lambda: FileLogger(self.local_dir, resume_step),
            "tensorboard": lambda: TensorboardLogger(self.local_dir, experiment),
            "wandb": lambda: WandbLogger(self.local_dir, project, experiment, config),
            "mlflow": lambda: MlflowLogger(self.local_dir, project, experiment, config),
        }
        for name in backends:
            if name not in makers:
                raise ValueError(
                    f"trainer.logger has unknown backend {name!r}: choose from {', '.join(makers)}"
                )
            self.backends[name] = makers[name]()

    @property
    def metrics_path(self) -> Path:
        """Where the ``file`` backend writes."""
        return self.local_dir / METRICS_FILE

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for backend in self.backends.values():
            backend.log(metrics, step)

    def finish(self) -> Path | None:
        """Close every backend; return the PNG of the curves when one was drawn."""
        for backend in self.backends.values():
            backend.close()
        png = plot_metrics(self.metrics_path) if "file" in self.backends else None
        self.backends = {}
        return png


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
