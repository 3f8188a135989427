"""A trainer resuming from a damaged checkpoint: auto falls back to the newest intact step and says what it
skipped; resume_path refuses it and names the step to use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sft_fixtures import make_arithmetic, make_tiny_model

from posttrain.trainers.logging import read_metrics
from posttrain.trainers.sft import run


def _flip_largest_tensor(role: Path) -> str:
    files = json.loads((role / "manifest.json").read_text())["checksums"]["files"]
    name, offset, length = max(
        ((n, o, ln) for n, rec in files.items() for o, ln, _, k in rec[1] if k and n.endswith(".distcp")),
        key=lambda s: s[2],
    )
    data = bytearray((role / name).read_bytes())
    middle = offset + length // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    (role / name).write_bytes(bytes(data))
    return name


def test_damaged_newest_step_falls_back_or_is_refused(tmp_path):
    train, _ = make_arithmetic(tmp_path, num_train=16, num_test=4)
    model = make_tiny_model(tmp_path)
    out = tmp_path / "run"
    args = [
        "--config",
        "sft_tiny",
        f"model.path={model}",
        f"data.train_files={train}",
        f"trainer.default_local_dir={out}",
        "trainer.logger=[file]",
        "trainer.save_freq=1",
        "data.train_batch_size=8",
    ]
    run([*args, "trainer.total_training_steps=2"])
    name = _flip_largest_tensor(out / "global_step_2" / "actor")
    with pytest.raises(ValueError, match=rf"(?s){name}.*trainer\.resume_from_path={out / 'global_step_1'}"):
        run(
            [
                *args,
                "trainer.total_training_steps=3",
                "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={out / 'global_step_2'}",
            ]
        )
    with pytest.warns(
        UserWarning, match=rf"resuming from {out / 'global_step_1'}.*skipped global_step_2 .*{name}"
    ):
        run([*args, "trainer.total_training_steps=3"])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
