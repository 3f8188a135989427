"""HFRollout's routing record (``rollout.return_routed_experts``) against a full HF forward over each
generated sequence, with the top-k recomputed from the router's input as Qwen3-MoE defines it."""

from __future__ import annotations

import pytest
import torch

from posttrain.core import RolloutConfig, SamplingConfig
from posttrain.core.testing import TINY_QWEN3_MOE, save_tiny_model
from posttrain.core.weight_sync import WeightSyncError
from posttrain.rollout_hf import HFRollout

PROMPTS = [[5, 17, 33, 101, 7], [9, 250], [44, 45, 46, 200, 201, 202, 203, 12]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return save_tiny_model(path, "qwen3_moe", eos_token_id=2, pad_token_id=0)


def reference_routing(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), layers, k): top-k of softmax(gate logits) of one unpadded, uncached forward over ``ids``."""
    k = model.config.num_experts_per_tok
    gates = [layer.mlp.gate for layer in model.model.layers]
    inputs: list[torch.Tensor] = []
    handles = [g.register_forward_hook(lambda m, args, out: inputs.append(args[0])) for g in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    picks = []
    for gate, hidden in zip(gates, inputs):
        logits = torch.nn.functional.linear(hidden.reshape(len(ids), -1), gate.weight)
        picks.append(torch.topk(torch.softmax(logits.double(), -1), k, dim=-1).indices)
    return torch.stack(picks, dim=1)


def test_rollout_records_the_routing_of_a_full_forward(moe_dir):
    cfg = RolloutConfig(dtype="float32", return_routed_experts=True)
    rollout = HFRollout(cfg, moe_dir, device="cpu")
    # many stop tokens: some rows finish early and leave the decode batch, others run to the length cap
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3, stop_token_ids=list(range(0, 256, 5)))
    samples = rollout.generate(PROMPTS, sampling)
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    assert min(len(s.response_ids) for s in samples) < 8
    layers, k = TINY_QWEN3_MOE["num_hidden_layers"], TINY_QWEN3_MOE["num_experts_per_tok"]
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        routed = s.routed_experts
        assert routed.shape == (len(ids), layers, k) and routed.dtype == torch.int32
        assert (routed[-1] == -1).all()  # the last sampled token was never fed to the model
        want = reference_routing(rollout.model, ids)[:-1]
        assert torch.equal(routed[:-1].sort(-1).values.long(), want.sort(-1).values), ids


def test_no_record_unless_asked(moe_dir):
    rollout = HFRollout(RolloutConfig(dtype="float32"), moe_dir, device="cpu")
    samples = rollout.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=3, seed=0))
    assert samples[0].routed_experts is None


def test_dense_model_is_refused(tiny_model_dir):
    rollout = HFRollout(RolloutConfig(dtype="float32", return_routed_experts=True), tiny_model_dir)
    with pytest.raises(ValueError, match="return_routed_experts=false"):
        rollout.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=3, seed=0))


def test_sync_of_per_expert_names_fills_the_fused_experts(moe_dir, tmp_path):
    """A stream named like the checkpoint (one tensor per expert projection, as the trainer exports it) loads
    into transformers' fused expert parameters as transformers' own checkpoint loader does."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    save_tiny_model(tmp_path, "qwen3_moe", seed=1, eos_token_id=2, pad_token_id=0)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stream = [(name, f.get_tensor(name)) for name in f.keys()]
    assert any(".experts.0.gate_proj." in name for name, _ in stream)
    rollout = HFRollout(RolloutConfig(dtype="float32", update_weights_bucket_megabytes=1), moe_dir)
    rollout.update_weights(iter(stream))
    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    got = rollout.model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    with pytest.raises(WeightSyncError, match="untouched"):  # one expert's up_proj missing
        rollout.update_weights(
            iter([(n, t) for n, t in stream if n != "model.layers.1.mlp.experts.3.up_proj.weight"])
        )
