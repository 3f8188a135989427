"""Context parallelism without Transformer Engine.

In one process: the split puts each row at the position Megatron-Core's THD RoPE gives it, and the
all-gather-KV attention of every rank's chunks equals causal attention over whole sequences. On two gloo ranks
(one torchrun launch, ``cp_worker.py``): at CP=2 on packed sequences of odd lengths, log-probs equal the HF
forward and CP=1 (also with temperatures and entropy), and one training step gives the loss, grad norm and
parameters of CP=1 and of plain HF + torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from posttrain.core.testing import torchrun
from posttrain.megatron.context_parallel import plan_split, varlen_causal_attention

CU = torch.tensor([0, 7, 20, 25, 36, 45])
"""Five sequences of odd lengths 7, 13, 5, 11, 9."""


@pytest.mark.parametrize(("cp", "sp"), [(2, 1), (2, 2), (3, 1), (4, 2)])
def test_split_matches_megatron_thd_rope(cp, sp):
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    splits = [plan_split(CU, sp, cp, r) for r in range(cp)]
    padded = splits[0].padded
    assert (padded % (2 * cp) == 0).all() and int(padded.sum()) % (2 * cp * sp) == 0
    everything = torch.cat([s.local_index for s in splits])
    assert torch.equal(everything.sort().values, torch.arange(int(padded.sum())))  # each position once
    t_local = splits[0].local_index.numel()
    positions = torch.arange(int(padded.max()))
    for rank, split in enumerate(splits):
        assert torch.equal(split.gathered_row[split.local_index], rank * t_local + torch.arange(t_local))
        local_pos = split.offset[split.local_index]
        # what Megatron's _apply_rotary_pos_emb_thd selects for each sequence of this rank's stream
        pieces = torch.split(local_pos, (padded // cp).tolist())
        rope = torch.cat([_get_thd_freqs_on_this_cp_rank(rank, cp, x, positions) for x in pieces])
        assert torch.equal(local_pos, rope)
    real = splits[0].real_index
    assert torch.equal(splits[0].offset[real], torch.cat([torch.arange(n) for n in (7, 13, 5, 11, 9)]))


@pytest.mark.parametrize("cp", [2, 3])
def test_all_gather_kv_attention_equals_causal_attention(cp):
    """Every rank's query chunks against the gathered key prefixes give the rows of full causal attention."""
    torch.manual_seed(0)
    splits = [plan_split(CU, 1, cp, r) for r in range(cp)]
    padded = splits[0].padded
    total, heads, dim = int(padded.sum()), 3, 8
    q, k, v = (torch.randn(total, heads, dim, dtype=torch.float64) for _ in range(3))
    reference = torch.cat(
        [
            F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in ts), is_causal=True).transpose(0, 1)
            for ts in zip(*(torch.split(t, padded.tolist()) for t in (q, k, v)))
        ]
    )
    gathered_k = torch.cat([k[s.local_index] for s in splits])  # what the all-gather returns
    gathered_v = torch.cat([v[s.local_index] for s in splits])
    for split in splits:
        plan = split.plan
        out = varlen_causal_attention(
            q[split.local_index],
            gathered_k[plan.kv_index],
            gathered_v[plan.kv_index],
            plan.cu_seqlens_q,
            plan.cu_seqlens_k,
            plan.max_seqlen_q,
            plan.max_seqlen_k,
            scale=dim**-0.5,
        )
        assert (out - reference[split.local_index]).abs().max() < 1e-12


@pytest.fixture(scope="module")
def cp_run(tiny_qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    torchrun(Path(__file__).with_name("cp_worker.py"), tiny_qwen2, out, "float32")
    return json.loads((out / "cp_results.json").read_text())["float32"]


@pytest.mark.dist
@pytest.mark.slow
def test_cp2_log_probs_equal_hf_and_cp1(cp_run):
    assert cp_run["cp2_logprob_vs_hf"] < 2e-5
    assert cp_run["cp1_logprob_vs_hf"] < 2e-5
    assert cp_run["cp2_logprob_vs_cp1"] < 2e-5
    assert cp_run["cp2_temperature_logprob_vs_cp1"] < 2e-5
    assert cp_run["cp2_entropy_vs_cp1"] < 2e-5


@pytest.mark.dist
@pytest.mark.slow
def test_cp2_training_step_equals_cp1_and_hf(cp_run):
    for ref in ("cp1", "hf"):
        assert cp_run[f"loss_vs_{ref}"] < 1e-5
        assert cp_run[f"grad_norm_rel_vs_{ref}"] < 1e-4
        assert cp_run[f"param_maxdiff_vs_{ref}"] < 1e-5  # 1% of one Adam step at lr=1e-3
    assert cp_run["cp2_value_vs_cp1"] < 2e-5
