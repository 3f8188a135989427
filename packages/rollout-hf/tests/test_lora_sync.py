"""LoRA syncs: base weights once, then adapters only, merged like peft's merge_and_unload."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_model
from test_rollout import PROMPTS, greedy_reference, make_rollout

from posttrain.core import SamplingConfig
from posttrain.core.weight_sync import WeightSyncError
from posttrain.rollout_hf.lora import lora_scaling, parse_adapter_name

peft = pytest.importorskip("peft")


def lora_model(base, seed: int):
    """A peft LoRA model over a copy of ``base`` with random (nonzero) adapters, as a trained actor has."""
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 3},
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, config


def adapter_stream(model):
    """Adapter tensors under peft's saved names, as the FSDP engine streams them with base_sync_done=True."""
    return [
        (n.replace(".default.", "."), t.detach().clone())
        for n, t in model.state_dict().items()
        if ".lora_" in n
    ]


def merged_greedy(model, steps: int = 8):
    merged = copy.deepcopy(model).merge_and_unload().eval()
    return [greedy_reference(merged, p, steps)[0] for p in PROMPTS]


def test_adapter_syncs_match_peft_merge(tiny_model_dir):
    base = build_tiny_model()
    rollout = make_rollout(tiny_model_dir)
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    before = [s.response_ids for s in rollout.generate(PROMPTS, greedy)]
    for seed in (1, 2):
        model, config = lora_model(base, seed)
        rollout.update_weights(iter(adapter_stream(model)), peft_config=config.to_dict(), base_sync_done=True)
        expected = merged_greedy(model)
        assert [s.response_ids for s in rollout.generate(PROMPTS, greedy)] == expected
        assert expected != before, "the adapter must change the greedy tokens for this test to mean anything"


def test_base_sync_then_adapter(tiny_model_dir):
    new_base = build_tiny_model(seed=7)
    rollout = make_rollout(tiny_model_dir)
    model, config = lora_model(new_base, 3)
    rollout.update_weights(
        iter(new_base.state_dict().items()), peft_config=config.to_dict(), base_sync_done=False
    )
    rollout.update_weights(iter(adapter_stream(model)), peft_config=config.to_dict(), base_sync_done=True)
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    assert [s.response_ids for s in rollout.generate(PROMPTS, greedy)] == merged_greedy(model)


def test_incomplete_or_foreign_adapter_streams_raise(tiny_model_dir):
    rollout = make_rollout(tiny_model_dir)
    model, config = lora_model(build_tiny_model(), 4)
    stream = adapter_stream(model)
    rollout.update_weights(iter(stream), peft_config=config.to_dict(), base_sync_done=True)
    with pytest.raises(WeightSyncError, match="without an update"):
        rollout.update_weights(
            iter([x for x in stream if ".layers.1." not in x[0]]),
            peft_config=config.to_dict(),
            base_sync_done=True,
        )
    with pytest.raises(WeightSyncError, match="only lora_A"):
        rollout.update_weights(
            iter([x for x in stream if "lora_B" not in x[0]]),
            peft_config=config.to_dict(),
            base_sync_done=True,
        )
    with pytest.raises(WeightSyncError, match="not a LoRA"):
        rollout.update_weights(
            iter([("model.norm.weight", torch.ones(128))]), peft_config=config.to_dict(), base_sync_done=True
        )


def test_scaling_and_names():
    cfg = {"r": 8, "lora_alpha": 16, "rank_pattern": {"v_proj": 4}, "alpha_pattern": {"layers.1.q_proj": 2}}
    assert lora_scaling(cfg, "model.layers.0.q_proj") == 2.0
    assert lora_scaling(cfg, "model.layers.0.v_proj") == 4.0
    assert lora_scaling(cfg, "model.layers.1.q_proj") == 0.25
    assert lora_scaling({**cfg, "use_rslora": True}, "model.layers.0.q_proj") == 16 / 8**0.5
    assert parse_adapter_name("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight") == (
        "model.layers.0.self_attn.q_proj",
        "B",
    )
