"""Retention (``posttrain.ckpt.retain``), the one implementation the step manager and the megatron engine's
direct saves share: which step directories go, which stay, and what a crash while deleting leaves behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from posttrain.ckpt import find_latest, retain, step_dirs
from posttrain.ckpt.layout import FORMAT, STEP_MANIFEST, write_json


def _complete(root: Path, step: int) -> Path:
    """A committed step directory (its step manifest, no roles)."""
    path = root / f"global_step_{step}"
    path.mkdir()
    write_json(path / STEP_MANIFEST, {"format": FORMAT, "global_step": step, "roles": []})
    return path


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keeps_the_newest_complete_and_clears_older_debris(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        _complete(tmp_path, s)
    (tmp_path / "global_step_9").mkdir()  # incomplete (a crashed direct save): neither counted nor deleted
    for debris in (".tmp.global_step_2", ".tmp.old.global_step_1", ".tmp.global_step_5"):
        (tmp_path / debris).mkdir()
    assert retain(tmp_path, 2, current=4) == [2, 1]
    assert _names(tmp_path) == [".tmp.global_step_5", "global_step_3", "global_step_4", "global_step_9"]
    assert retain(tmp_path, None, current=4) == []  # keep all: only debris of older steps goes
    assert retain(tmp_path, 1, current=3) == [4]  # the current step stays, whatever the others' numbers
    with pytest.raises(ValueError, match="max_ckpt_to_keep=0 must be >= 1"):
        retain(tmp_path, 0, current=3)


def test_candidates_can_be_given(tmp_path: Path) -> None:
    """A direct save has no step manifest: its caller names which directories count (every one named here)."""
    for s in (1, 2, 3):
        (tmp_path / f"global_step_{s}" / "actor").mkdir(parents=True)
    (tmp_path / "not_a_step").mkdir()
    assert sorted(step_dirs(tmp_path)) == [1, 2, 3]
    assert retain(tmp_path, 2, current=3, steps=step_dirs(tmp_path)) == [1]
    assert _names(tmp_path) == ["global_step_2", "global_step_3", "not_a_step"]


def test_a_crash_while_deleting_leaves_hidden_debris(tmp_path: Path, monkeypatch) -> None:
    """The directory to delete is renamed first: a deletion that dies half-way leaves ``.tmp.old.*`` (never
    read, removed by the next retention), not a damaged ``global_step_<N>`` that could pass as a
    checkpoint."""
    for s in (1, 2):
        _complete(tmp_path, s)
    rmtree = shutil.rmtree

    def dies_half_way(path, ignore_errors=False):
        if Path(path).name.startswith(".tmp.old.") and not ignore_errors:
            (Path(path) / STEP_MANIFEST).unlink()  # part of the tree is gone when the process dies
            raise KeyboardInterrupt("killed while deleting")
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        retain(tmp_path, 1, current=2)
    assert _names(tmp_path) == [".tmp.old.global_step_1", "global_step_2"]
    assert find_latest(tmp_path) == (2, tmp_path / "global_step_2")
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    _complete(tmp_path, 3)
    assert retain(tmp_path, 2, current=3) == []
    assert _names(tmp_path) == ["global_step_2", "global_step_3"]
