"""Device tests of context parallelism without Transformer Engine (carried Megatron wheels, NCCL).

On one GPU: ``torch.nn.attention.varlen.varlen_attn`` (flash, bf16) with fewer queries than keys is causal
aligned to the bottom right, as the all-gather-KV attention needs. On two GPUs: ``cp_worker.py`` in bf16 (the
varlen path) with the distributed optimizer, CP=2 against CP=1 and the fp32 HF reference. Run by the lead on
the GPU machine:
``eval "$(bash scripts/install_megatron_wheels.sh)"; pytest packages/engine-megatron/tests/test_gpu_cp.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.core.testing import torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HERE = Path(__file__).parent


def test_varlen_flash_is_bottom_right_causal():
    from posttrain.megatron.context_parallel import plan_split, varlen_causal_attention

    torch.manual_seed(0)
    cu = torch.tensor([0, 70, 201, 260])
    heads, dim = 4, 64
    for rank in (0, 1):
        plan = plan_split(cu, 1, 2, rank).plan
        q = torch.randn(int(plan.cu_seqlens_q[-1]), heads, dim, device="cuda")
        k, v = (torch.randn(int(plan.cu_seqlens_k[-1]), heads, dim, device="cuda") for _ in range(2))
        args = (
            plan.cu_seqlens_q.cuda(),
            plan.cu_seqlens_k.cuda(),
            plan.max_seqlen_q,
            plan.max_seqlen_k,
            0.125,
        )
        flash = varlen_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args)
        masked = varlen_causal_attention(q, k, v, *args)  # fp32: SDPA with the mask written out
        assert (flash.float() - masked).abs().max() < 3e-2


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cp2_bf16_equals_cp1_on_two_gpus(tmp_path):
    from megatron_cpu import make_tiny_qwen2

    hf = make_tiny_qwen2(str(tmp_path / "hf"))
    torchrun(
        HERE / "cp_worker.py",
        hf,
        tmp_path,
        "bfloat16",
        json.dumps({"use_distributed_optimizer": True}),
        timeout=600,
    )
    res = json.loads((tmp_path / "cp_results.json").read_text())["bfloat16"]
    assert res["cp2_cp_size"] == 2
    for key in (
        "cp2_logprob_vs_cp1",
        "cp2_temperature_logprob_vs_cp1",
        "cp2_entropy_vs_cp1",
        "cp2_value_vs_cp1",
    ):
        assert res[key] < 5e-2, key  # bf16 noise; a misaligned causal mask is off by O(1)
    assert res["cp2_logprob_vs_hf"] < 1e-1
    assert res["loss_vs_cp1"] < 1e-2 and res["loss_vs_hf"] < 5e-2
    assert res["grad_norm_rel_vs_cp1"] < 5e-2
    assert res["param_maxdiff_vs_cp1"] < 1e-2  # one bf16 ulp of a weight near 1
