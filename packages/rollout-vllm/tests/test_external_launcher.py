"""vLLM's external_launcher under torchrun, colocated with the FSDP engine in the same process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow, pytest.mark.dist]


def test_torchrun_colocated_sync(model_dir):
    job = Path(__file__).with_name("launcher_job.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(job), model_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and "RANK 0 OK" in proc.stdout and "RANK 1 OK" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
