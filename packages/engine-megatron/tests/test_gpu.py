"""Device tests (2 GPUs, carried Megatron wheels, no Transformer Engine): TP=2, PP=2 and Megatron-FSDP equal the
HF reference, and a tiny Qwen3-MoE at EP=2 trains with router replay. Run by the lead on the GPU machine:
``eval "$(bash scripts/install_megatron_wheels.sh)"; pytest packages/engine-megatron/tests/test_gpu.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

HERE = Path(__file__).parent


def _torchrun(script: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_tp2_pp2_megatron_fsdp_equal_hf_reference(tmp_path):
    sys.path.insert(0, str(HERE))
    from megatron_cpu import make_tiny_qwen2

    hf = make_tiny_qwen2(str(tmp_path / "hf"))
    _torchrun("dist_worker.py", hf, str(tmp_path), json.dumps({"use_distributed_optimizer": True}))
    results = {}
    for rank in (0, 1):
        results.update(json.loads((tmp_path / f"results_rank{rank}.json").read_text()))
    for layout in ("tp2", "pp2", "fsdp"):
        assert results[f"{layout}_loss_diff"] < 1e-5
        assert results[f"{layout}_grad_norm_rel"] < 1e-4
        assert results[f"{layout}_param_maxdiff"] < 2e-5
    for layout in ("tp2", "pp2", "vpp2"):
        assert results[f"{layout}_logprob_maxdiff"] < 2e-5


def test_moe_ep2_router_replay(tmp_path):
    _torchrun("moe_worker.py", str(tmp_path))
    for res in json.loads((tmp_path / "moe_results.json").read_text()):
        assert res["record_deterministic"]
        assert res["replay_logprob_maxdiff"] == 0.0
        assert res["other_routing_logprob_maxdiff"] > 1e-3
        assert res["losses"][2] < res["losses"][0]
