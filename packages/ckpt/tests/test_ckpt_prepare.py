"""Host buffers allocated ahead of the first async save: reused by the snapshot, and the files match a sync
save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_crash_worker import CONTENTS, step, tiny_model
from ckpt_testlib import assert_identical, full_state

from posttrain.ckpt import (
    AsyncWriter,
    CheckpointManager,
    RoleInfo,
    RoleState,
    load_role,
    prepare_role,
    save_role,
)
from posttrain.ckpt.hf import tensor_table
from posttrain.ckpt.snapshot import snapshot_to_host
from posttrain.core.config import CheckpointConfig


def _save(mgr: CheckpointManager, state: RoleState, s: int) -> Path:
    staging = mgr.stage(s)
    save_role(staging / "actor", state, RoleInfo(), CONTENTS, s, writer=mgr.writer)
    mgr.commit(s)
    mgr.wait()
    return mgr.step_dir(s) / "actor"


def test_prepared_buffers_are_reused_and_files_match_sync_save(tmp_path: Path) -> None:
    model, opt = tiny_model()
    step(model, opt, 1)
    state = RoleState(model=model, optimizer=opt, counters={"global_step": 1})
    amgr = CheckpointManager(tmp_path / "async", CheckpointConfig(async_save=True))
    prepared = prepare_role("actor", state, CONTENTS, amgr.writer)
    async_dir = _save(amgr, state, 1)  # waits for the allocation if it is still running
    buffers = prepared.result()
    assert buffers and amgr.writer.host_buffers.keys() == buffers.keys()
    assert all(amgr.writer.host_buffers[k] is v for k, v in buffers.items())  # no buffer allocated again
    amgr.close()
    sync_dir = _save(CheckpointManager(tmp_path / "sync", CheckpointConfig()), state, 1)

    assert list(tensor_table(async_dir / "dist_ckpt")) == list(tensor_table(sync_dir / "dist_ckpt"))
    loaded = []
    for role_dir in (async_dir, sync_dir):
        fresh, fresh_opt = tiny_model()
        assert load_role(role_dir, RoleState(model=fresh, optimizer=fresh_opt), CONTENTS) == {
            "global_step": 1
        }
        loaded.append(full_state(fresh, fresh_opt))
    assert_identical(loaded[0], loaded[1], "async (prepared) vs sync")
    assert_identical(loaded[0], full_state(model, opt), "async (prepared) vs live")


def test_snapshot_allocates_when_a_prepared_shape_no_longer_fits() -> None:
    writer = AsyncWriter()
    writer.prepare({"a": torch.zeros(4), "b": torch.zeros(2)}, "p")
    prepared = dict(writer.ready_buffers())
    out = snapshot_to_host({"a": torch.ones(4), "b": torch.ones(5)}, writer.ready_buffers(), "p")
    assert out["a"] is prepared["p.a"] and torch.equal(out["a"], torch.ones(4))
    assert out["b"] is not prepared["p.b"] and torch.equal(out["b"], torch.ones(5))
    writer.close()


def test_prepare_before_the_first_step_raises_with_fix() -> None:
    model, opt = tiny_model()
    writer = AsyncWriter()
    with pytest.raises(ValueError, match="call it after the first step"):
        prepare_role("actor", RoleState(model=model, optimizer=opt), CONTENTS, writer)
    writer.close()
