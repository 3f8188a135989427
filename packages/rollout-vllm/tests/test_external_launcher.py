"""vLLM's external_launcher under torchrun, colocated with the FSDP engine in the same process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow, pytest.mark.dist]


def test_torchrun_colocated_sync(model_dir):
    job = Path(__file__).with_name("launcher_job.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = torch.cuda.device_count() or 2  # one rank per GPU (NCCL refuses two on one), else 2 on gloo
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), str(job), model_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and all(f"RANK {r} OK" in proc.stdout for r in range(ranks)), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
