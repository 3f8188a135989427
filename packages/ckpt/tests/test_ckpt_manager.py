"""CheckpointManager in one process: layout, tracker, latest(), retention, async save, contents validation."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_crash_worker import CONTENTS, save, step, tiny_model

from posttrain.ckpt import (
    TRACKER,
    CheckpointManager,
    CheckpointWriteError,
    RoleInfo,
    RoleState,
    capture_rng,
    find_latest,
    load_role,
    restore_rng,
    save_role,
)
from posttrain.ckpt.cli import main as ckpt_cli
from posttrain.core.config import CheckpointConfig


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_layout_tracker_and_retention(tmp_path: Path) -> None:
    model, opt = tiny_model()
    mgr = CheckpointManager(tmp_path, CheckpointConfig(max_ckpt_to_keep=2))
    assert mgr.latest() is None
    for s in (1, 2, 3):
        step(model, opt, s)
        save(mgr, model, opt, s)
        assert (tmp_path / TRACKER).read_text() == f"{s}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3", TRACKER]
    step_dir = tmp_path / "global_step_3"
    assert sorted(p.name for p in step_dir.iterdir()) == ["actor", "checkpoint.json", "data.pt"]
    assert sorted(p.name for p in (step_dir / "actor").iterdir()) == [
        "dist_ckpt",
        "huggingface",
        "manifest.json",
    ]
    assert mgr.latest() == (3, step_dir)


def test_latest_ignores_incomplete_and_misnamed(tmp_path: Path) -> None:
    model, opt = tiny_model()
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    save(mgr, model, opt, 5)
    (tmp_path / "global_step_9").mkdir()  # no checkpoint.json: not complete
    (tmp_path / ".tmp.global_step_7").mkdir()  # a save in progress
    (tmp_path / "global_step_5").rename(tmp_path / "global_step_05_backup")
    assert find_latest(tmp_path) is None  # step only from an exact global_step_<N> name
    (tmp_path / "global_step_05_backup").rename(tmp_path / "global_step_5")
    (tmp_path / TRACKER).write_text("9\n")  # tracker names an incomplete directory: fall back to the scan
    assert find_latest(tmp_path) == (5, tmp_path / "global_step_5")
    (tmp_path / TRACKER).write_text("garbage")
    assert find_latest(tmp_path) == (5, tmp_path / "global_step_5")
    (tmp_path / "global_step_5" / "actor" / "manifest.json").unlink()  # a role without its manifest
    assert find_latest(tmp_path) is None


def test_commit_without_stage_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"call stage\(4\)"):
        CheckpointManager(tmp_path, CheckpointConfig()).commit(4)


def test_async_save_snapshots_then_writes_in_background(tmp_path: Path) -> None:
    model, opt = tiny_model()
    mgr = CheckpointManager(tmp_path, CheckpointConfig(async_save=True))
    step(model, opt, 1)
    saved = _params(model)
    staging = mgr.stage(1)
    save_role(
        staging / "actor", RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, 1, writer=mgr.writer
    )
    mgr.commit(1)
    step(model, opt, 2)  # training goes on while the write runs: the checkpoint must hold step-1 values
    staging = mgr.stage(2)  # waits for the first save
    assert mgr.latest()[0] == 1
    save_role(
        staging / "actor", RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, 2, writer=mgr.writer
    )
    mgr.commit(2)
    mgr.close()
    fresh, fresh_opt = tiny_model()
    load_role(tmp_path / "global_step_1" / "actor", RoleState(model=fresh, optimizer=fresh_opt), CONTENTS)
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    assert mgr.latest()[0] == 2


def test_async_write_failure_skips_commit_and_raises(tmp_path: Path) -> None:
    model, opt = tiny_model()
    mgr = CheckpointManager(tmp_path, CheckpointConfig(async_save=True))
    save(mgr, model, opt, 1)
    staging = mgr.stage(2)
    (staging / "actor").write_text("a file where the role directory should go")
    save_role(
        staging / "actor", RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, 2, writer=mgr.writer
    )
    mgr.commit(2)
    with pytest.raises(CheckpointWriteError, match="async checkpoint save failed"):
        mgr.wait()
    assert mgr.latest() == (1, tmp_path / "global_step_1") and not (tmp_path / "global_step_2").exists()
    mgr.close()


INVALID = [
    c
    for n in range(1, 4)
    for c in itertools.combinations(["model", "optimizer", "extra", "hf_model"], n)
    if ("hf_model" in c or "optimizer" in c) and "model" not in c
]


@pytest.mark.parametrize("contents", INVALID, ids="-".join)
def test_invalid_contents_raise_with_fix(contents: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="add model to checkpoint.save_contents"):
        CheckpointConfig(save_contents=list(contents))
    with pytest.raises(ValueError, match="add model to checkpoint.load_contents"):
        CheckpointConfig(load_contents=list(contents))
    model, opt = tiny_model()
    with pytest.raises(ValueError, match="add model to checkpoint.save_contents"):
        save_role("/nonexistent", RoleState(model=model, optimizer=opt), RoleInfo(), list(contents), 0)


def test_contents_that_do_not_fit_the_role_raise_with_fix(tmp_path: Path) -> None:
    model, opt = tiny_model()
    with pytest.raises(ValueError, match="remove optimizer from checkpoint.save_contents"):
        save_role(tmp_path / "a", RoleState(model=model), RoleInfo(), ["model", "optimizer"], 0)
    save_role(tmp_path / "a", RoleState(model=model), RoleInfo(), ["model"], 0)
    with pytest.raises(ValueError, match=r"remove \['optimizer', 'extra'\] from checkpoint.load_contents"):
        load_role(tmp_path / "a", RoleState(model=model, optimizer=opt), CONTENTS)
    with pytest.raises(ValueError, match="not a complete posttrain checkpoint role"):
        load_role(tmp_path, RoleState(model=model), ["model"])


def test_rng_roundtrip() -> None:
    state = capture_rng()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng(state)
    assert (random.random(), float(np.random.rand())) == expected[:2] and torch.equal(
        torch.rand(3), expected[2]
    )


def test_cli_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ckpt_cli(["export-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "huggingface/config.json is missing" in capsys.readouterr().err
    assert ckpt_cli(["inspect", str(tmp_path)]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_extra_on_more_ranks_than_saved_keeps_rng_and_warns(tmp_path: Path) -> None:
    from posttrain.ckpt.extra import capture_extra, load_extra, save_extra

    model, opt = tiny_model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    step(model, opt, 1)
    sched.step()
    save_extra(tmp_path, 0, capture_extra(sched, {"global_step": 3}))
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(tiny_model()[1], lambda s: 0.5**s)
    before = capture_rng()
    with pytest.warns(UserWarning, match="no RNG state for rank 1"):
        assert load_extra(tmp_path, 1, fresh_sched) == {"global_step": 3}
    assert fresh_sched.state_dict()["last_epoch"] == 1 and torch.equal(
        capture_rng()["torch"], before["torch"]
    )
