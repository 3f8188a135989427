"""Metrics tracking shared by the SFT and RL trainers: console progress, metrics.jsonl, TensorBoard, wandb,
MLflow, and a PNG of the curves at the end."""

from .plot import plot_metrics
from .tracker import Tracker, read_metrics

__all__ = ["Tracker", "plot_metrics", "read_metrics"]
