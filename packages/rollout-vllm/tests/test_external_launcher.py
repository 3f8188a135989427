"""vLLM's external_launcher under torchrun, colocated with the FSDP engine in the same process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import needs_vllm

from posttrain.core.testing import torchrun

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow, pytest.mark.dist]


def test_torchrun_colocated_sync(model_dir):
    ranks = torch.cuda.device_count() or 2  # one rank per GPU (NCCL refuses two on one), else 2 on gloo
    proc = torchrun(Path(__file__).with_name("launcher_job.py"), model_dir, nproc=ranks, timeout=300)
    assert all(f"RANK {r} OK" in proc.stdout for r in range(ranks)), proc.stdout[-3000:] + proc.stderr[-3000:]
