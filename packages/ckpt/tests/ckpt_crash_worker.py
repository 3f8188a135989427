"""Subprocess of test_ckpt_crash.py: per crash point, a forked child commits step 1 into ``<root>/<point>``,
then dies (``os._exit``) at that point while saving step 2; the exit codes go to ``<root>/exit_codes.json``.
Forking after the imports keeps the cost of importing torch to one process.

Points: ``mid-write`` (the first fsync, once DCP has written the shards), ``before-rename`` (the rename of the
staging directory), ``before-tracker`` (the rename that would update latest_checkpointed_iteration.txt).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from posttrain.ckpt import CheckpointManager, RoleInfo, RoleState, save_role
from posttrain.ckpt.layout import TRACKER
from posttrain.core.config import CheckpointConfig

CRASH_CODE = 17
CONTENTS = ["model", "optimizer", "extra"]


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP and its AdamW, seeded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """One optimizer step on a batch that depends only on ``i``."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def save(mgr: CheckpointManager, model: torch.nn.Module, opt: torch.optim.Optimizer, s: int) -> None:
    """Stage, save the role and the trainer state, commit."""
    staging = mgr.stage(s)
    save_role(
        staging / "actor",
        RoleState(model=model, optimizer=opt, counters={"global_step": s}),
        RoleInfo(),
        CONTENTS,
        s,
    )
    mgr.save_trainer_state(s, {"global_step": s})
    mgr.commit(s)


def install_crash(point: str) -> None:
    """Make the process exit at ``point`` (patched os functions; nothing in posttrain.ckpt is changed)."""
    real_replace = os.replace

    def crash_fsync(fd: int) -> None:
        os._exit(CRASH_CODE)

    def crash_replace(src, dst) -> None:
        if point == "before-rename" and Path(src).name.startswith(".tmp.global_step_"):
            os._exit(CRASH_CODE)
        if point == "before-tracker" and Path(dst).name == TRACKER:
            os._exit(CRASH_CODE)
        real_replace(src, dst)

    if point == "mid-write":
        os.fsync = crash_fsync
    else:
        os.replace = crash_replace


def scenario(root: Path, point: str) -> None:
    root.mkdir(parents=True)
    model, opt = tiny_model()
    mgr = CheckpointManager(root, CheckpointConfig(save_contents=CONTENTS, max_ckpt_to_keep=1))
    step(model, opt, 1)
    save(mgr, model, opt, 1)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "ref_step1.pt")
    step(model, opt, 2)
    install_crash(point)
    save(mgr, model, opt, 2)
    raise SystemExit(f"crash point {point} was never reached")


def main(root: Path, points: list[str]) -> None:
    codes = {}
    for point in points:
        pid = os.fork()
        if pid == 0:
            try:
                scenario(root / point, point)
            finally:
                os._exit(1)
        codes[point] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    (root / "exit_codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
