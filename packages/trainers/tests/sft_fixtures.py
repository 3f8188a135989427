"""Shared helpers of the SFT, data, model-init and RL tests: the tiny offline model, synthetic data on disk,
and a machine on which posttrain would pick another torch thread count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posttrain.trainers.data.convert import write_parquet
from posttrain.trainers.data.synthetic import arithmetic_rows
from posttrain.trainers.model_init import init_model


def make_tiny_model(root: Path) -> Path:
    return init_model(root / "tiny", arch="qwen2", size="tiny", seed=0)


def make_arithmetic(root: Path, num_train: int = 256, num_test: int = 32) -> tuple[Path, Path]:
    splits = arithmetic_rows(num_train, num_test, digits=2, seed=0)
    return (
        write_parquet(splits["train"], root / "data" / "train.parquet"),
        write_parquet(splits["test"], root / "data" / "test.parquet"),
    )


@contextlib.contextmanager
def threads_picked_elsewhere(monkeypatch: pytest.MonkeyPatch, saved: int) -> Iterator[None]:
    """Make ``threads.configure()`` alone pick a count other than ``saved`` (no OMP_NUM_THREADS, an affinity
    of that many cores, no load) for the block; torch's thread count is restored after it."""
    other = 1 if saved > 1 else 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(other)))
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)
