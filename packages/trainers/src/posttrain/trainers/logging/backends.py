"""One class per metrics backend, each with ``log(metrics, step)`` and ``close()``.

The heavy ones (TensorBoard, wandb, MLflow) import their library only when selected and say how to install it
when it is missing. ``file`` appends one JSON object per step to ``metrics.jsonl``; on resume it first drops
the lines of steps after the checkpoint, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def import_backend(module: str, backend: str, package: str) -> Any:
    """Import ``module`` or raise an ImportError with the install command for ``backend``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"trainer.logger includes {backend!r} but {module!r} cannot be imported ({exc}): "
            f"pip install {package}, or remove {backend} from trainer.logger"
        ) from None


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))
    }


class FileLogger:
    """``<dir>/metrics.jsonl``: ``{"step": N, "train/loss": ..., ...}`` per line."""

    def __init__(self, local_dir: str | Path, resume_step: int = 0) -> None:
        self.path = Path(local_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line).get("step", 0) <= resume_step:
                    kept.append(line)
        self.path.write_text("".join(f"{line}\n" for line in kept))
        self._f = open(self.path, "a")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._f.write(json.dumps({"step": step, **_finite(metrics)}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorboardLogger:
    """Scalars under ``<dir>/tensorboard`` (or ``$TENSORBOARD_DIR``)."""

    def __init__(self, local_dir: str | Path, experiment: str) -> None:
        import_backend("tensorboard", "tensorboard", "tensorboard")
        writer_mod = import_backend("torch.utils.tensorboard", "tensorboard", "tensorboard")
        log_dir = os.environ.get("TENSORBOARD_DIR") or str(Path(local_dir) / "tensorboard" / experiment)
        self.writer = writer_mod.SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in _finite(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run; ``WANDB_MODE=offline`` writes it under ``<dir>/wandb`` with no network."""

    def __init__(self, local_dir: str | Path, project: str, experiment: str, config: dict[str, Any]) -> None:
        wandb = import_backend("wandb", "wandb", "wandb")
        self.run = wandb.init(
            project=project, name=experiment, config=config, dir=str(local_dir), reinit=True
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run in ``$MLFLOW_TRACKING_URI``, else in a local file store ``<dir>/mlruns``.

    MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true, so this sets that variable when
    it picks the local default (a SQLite store takes ~30 s to create; point ``MLFLOW_TRACKING_URI`` at one, or
    at a server, to use it instead)."""

    def __init__(self, local_dir: str | Path, project: str, experiment: str, config: dict[str, Any]) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(local_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow = import_backend("mlflow", "mlflow", "mlflow")
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.set_experiment(project)
        self.run = self.mlflow.start_run(run_name=experiment)
        self.mlflow.log_dict(config, "config.json")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.mlflow.log_metrics(_finite(metrics), step=step)

    def close(self) -> None:
        self.mlflow.end_run()
