"""Crash injection: a real process dies while saving step 2; resume must find step 1 intact and nothing
lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_crash_worker import CONTENTS, CRASH_CODE, save, step, tiny_model

from posttrain.ckpt import CheckpointManager, RoleState, find_latest, load_role, load_trainer_state
from posttrain.ckpt.layout import TRACKER
from posttrain.core.config import CheckpointConfig

WORKER = Path(__file__).parent / "ckpt_crash_worker.py"
POINTS = ["mid-write", "before-rename", "before-tracker"]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("crash")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(root), *POINTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("point", POINTS)
def test_crash_leaves_previous_checkpoint(crashed: Path, point: str) -> None:
    assert json.loads((crashed / "exit_codes.json").read_text())[point] == CRASH_CODE
    root = crashed / point
    assert (root / TRACKER).read_text().strip() == "1"
    latest = find_latest(root)
    assert latest is not None and latest[0] == 1 and latest[1].name == "global_step_1"
    if point == "before-tracker":  # renamed and complete, but never committed through the tracker
        assert (root / "global_step_2").is_dir()
    else:
        assert (root / ".tmp.global_step_2").is_dir() and not (root / "global_step_2").exists()

    model, opt = tiny_model()
    counters = load_role(latest[1] / "actor", RoleState(model=model, optimizer=opt), CONTENTS)
    assert counters == {"global_step": 1}
    assert load_trainer_state(latest[1]) == {"global_step": 1}
    ref = torch.load(root / "ref_step1.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k

    # saving step 2 again replaces the debris, then retention (max_ckpt_to_keep=1) drops step 1
    mgr = CheckpointManager(root, CheckpointConfig(save_contents=CONTENTS, max_ckpt_to_keep=1))
    step(model, opt, 2)
    save(mgr, model, opt, 2)
    assert find_latest(root)[0] == 2
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["global_step_2"]
