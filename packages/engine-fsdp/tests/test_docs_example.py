"""The code example of docs/fsdp-engine.md runs as written and trains (its loss falls)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "fsdp-engine.md"


def test_fsdp_engine_doc_example_runs():
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[:1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\S+),", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout
