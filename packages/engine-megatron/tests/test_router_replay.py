"""MoE (a tiny Qwen3-MoE, local SequentialMLP experts) on one CPU process: log-probs equal HF, and R2 router
replay records routing in the log-prob pass and replays exactly that routing in the update."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from moe_worker import TINY_QWEN3_MOE
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = str(tmp_path_factory.mktemp("qwen3moe"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**TINY_QWEN3_MOE)).save_pretrained(path)
    return path


def test_r2_records_and_replays_routing(megatron_env, tiny_moe, packed_batch):
    from megatron_cpu import hf_log_probs, make_engine, nll_loss
    from moe_worker import TINY_QWEN3_MOE
    from transformers import AutoModelForCausalLM

    from posttrain.core.config import RouterReplayConfig

    eng = make_engine(tiny_moe, router_replay=RouterReplayConfig(mode="R2"))
    batch = packed_batch.select([0, 2])
    with eng.eval_mode():
        first = eng.infer_batch(batch)["model_output"]
        again = eng.infer_batch(batch)["model_output"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(first["log_probs"].double(), hf_log_probs(hf, batch), atol=2e-5, rtol=0)
    routed = first["routed_experts"]
    assert routed.shape == (
        batch.num_tokens,
        TINY_QWEN3_MOE["num_hidden_layers"],
        TINY_QWEN3_MOE["num_experts_per_tok"],
    )
    assert torch.equal(routed, again["routed_experts"])

    captured: list[torch.Tensor] = []

    def capture(out, micro, ctx):
        captured.append(out["log_probs"].detach())
        return nll_loss(out, micro, ctx)

    with eng.train_mode():
        batch.meta["routed_experts"] = routed
        eng.forward_backward_batch(batch, capture)
        eng.optimizer_zero_grad()
        batch.meta["routed_experts"] = (routed + 1) % TINY_QWEN3_MOE["num_experts"]
        eng.forward_backward_batch(batch, capture)
        eng.optimizer_zero_grad()
        batch.meta["routed_experts"] = routed
        losses = [sum(eng.train_batch(batch, nll_loss)["loss"]) for _ in range(3)]
    assert torch.equal(captured[0], first["log_probs"])  # replaying the record reproduces the pass exactly
    assert (captured[1] - first["log_probs"]).abs().max() > 1e-3  # and replay really drives the routers
    assert losses[2] < losses[0]
