"""Shared helpers of the SFT, data and model-init tests: the tiny offline model and synthetic data on disk."""

from __future__ import annotations

from pathlib import Path

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
