"""``examples/compose_trainer.py`` runs as written: a hand-composed loop over the FSDP2 engine, a checkpoint,
a resume with an identical loss and a checked rollout weight sync (docs/library.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "compose_trainer.py"


def test_compose_trainer_example_runs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert (
        "resumed at step 3" in out and "rollout sync: " in out and out.strip().endswith("compose_trainer: OK")
    )
    assert (tmp_path / "ckpt" / "global_step_3" / "actor").is_dir()
