"""LoRA in the megatron engine (one CPU process, TP=1; 2 gloo ranks at TP=2 and PP=2) against
transformers + peft.

One engine is trained for one step (so the adapter's B is non-zero); its adapter stream is loaded into peft on
the HF model, which is the reference for the engine's log-probs, its merged stream and its base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.core.testing import torchrun

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8


def make_lora_engine(path: str, *, model_kw=None, cls_name="MegatronLanguageModelEngine", **engine_kw):
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.megatron import engine as engine_mod
    from posttrain.megatron.config import McoreEngineConfig

    kw = dict(
        dtype="float32", use_distributed_optimizer=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2
    )
    kw.update(engine_kw)
    eng = getattr(engine_mod, cls_name)(
        ModelConfig(path=path, lora_rank=RANK, lora_alpha=ALPHA, **(model_kw or {})),
        McoreEngineConfig(**kw),
        OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        CheckpointConfig(),
    )
    eng.initialize()
    return eng


def _params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.chunks[0].named_parameters()}


@pytest.fixture(scope="module")
def trained(megatron_env, tiny_qwen2):
    """(engine after one step, parameters before it, requires_grad per parameter)."""
    from megatron_cpu import nll_loss, sample_batch

    eng = make_lora_engine(tiny_qwen2)
    before = _params(eng)
    trainable = {n: p.requires_grad for n, p in eng.chunks[0].named_parameters()}
    with eng.train_mode():
        eng.train_batch(sample_batch(), nll_loss)
    return eng, before, trainable


def _engine_log_probs(eng, batch) -> torch.Tensor:
    with eng.eval_mode():
        return eng.infer_batch(batch)["model_output"]["log_probs"].double()


def _peft_model(eng, base_path):
    """The HF base model + peft, loaded from the engine's adapter stream and config dict."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    stream, config = eng.get_per_tensor_param(base_sync_done=True, peft_merge=False)
    adapter = {k: v.cpu() for k, v in stream}
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), LoraConfig(**config)
    )
    result = set_peft_model_state_dict(model, adapter)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if ".lora_" in k]
    return model, adapter, config


def test_one_step_trains_only_the_adapter(trained):
    eng, before, trainable = trained
    after = _params(eng)
    adapters = {n for n in before if ".adapter." in n}
    assert adapters and {n for n, t in trainable.items() if t} == adapters
    for name in before.keys() - adapters:
        assert torch.equal(before[name], after[name]), f"base parameter {name} changed"
    assert all(not torch.equal(before[n], after[n]) for n in adapters if n.endswith("linear_out.weight"))


def test_adapter_stream_loads_into_peft_and_matches_log_probs(trained, tiny_qwen2, packed_batch):
    from megatron_cpu import hf_log_probs

    eng = trained[0]
    model, adapter, config = _peft_model(eng, tiny_qwen2)
    assert all(k.startswith("base_model.model.model.layers.") for k in adapter)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    ours = _engine_log_probs(eng, packed_batch)
    with torch.no_grad():
        ref = hf_log_probs(model, packed_batch)
        with model.disable_adapter():
            base = hf_log_probs(model, packed_batch)
    assert (ref - base).abs().max() > 1e-3  # the adapter matters, so the comparison below means something
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_merged_stream_equals_peft_merge_and_unload(trained, tiny_qwen2):
    eng = trained[0]
    model, _, _ = _peft_model(eng, tiny_qwen2)
    ref = model.merge_and_unload().state_dict()
    stream, config = eng.get_per_tensor_param(peft_merge=True)
    merged = {k: v.cpu() for k, v in stream}
    assert config is None and sorted(merged) == sorted(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_base_stream_and_disable_adapter_give_the_base_model(trained, tiny_qwen2, packed_batch):
    from megatron_cpu import hf_log_probs
    from transformers import AutoModelForCausalLM

    eng = trained[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    stream, config = eng.get_per_tensor_param(base_sync_done=False, dtype=torch.float32)
    base = {k: v.cpu() for k, v in stream}
    assert config is not None and sorted(base) == sorted(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(base[name], tensor), name
    with eng.disable_adapter():
        ours = _engine_log_probs(eng, packed_batch)
    with torch.no_grad():
        ref = hf_log_probs(hf, packed_batch)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(_engine_log_probs(eng, packed_batch), ref, atol=1e-3, rtol=0)  # adapter back on


def test_checkpoint_round_trip_keeps_the_adapter(trained, tiny_qwen2, tmp_path):
    from megatron_cpu import nll_loss, sample_batch

    eng = trained[0]
    role_dir = tmp_path / "global_step_1" / "actor"
    with eng.train_mode():
        eng.save_checkpoint(str(role_dir), global_step=1)
    fresh = make_lora_engine(tiny_qwen2)
    with fresh.train_mode():
        fresh.load_checkpoint(str(role_dir))
    saved, loaded = _params(eng), _params(fresh)
    assert sorted(saved) == sorted(loaded)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    with eng.train_mode(), fresh.train_mode():  # the Adam moments came back too: the next step is the same
        eng.train_batch(sample_batch(), nll_loss)
        fresh.train_batch(sample_batch(), nll_loss)
    for name, tensor in _params(eng).items():
        torch.testing.assert_close(_params(fresh)[name], tensor, atol=1e-7, rtol=0, msg=name)


def test_base_dist_ckpt_loads_under_fresh_adapters(megatron_env, tiny_qwen2, tmp_path):
    from megatron_cpu import make_engine
    from transformers import AutoModelForCausalLM

    base = make_engine(tiny_qwen2)
    base.save_checkpoint(str(tmp_path / "base"), global_step=0)
    eng = make_lora_engine(
        tiny_qwen2,
        use_dist_checkpointing=True,
        dist_checkpointing_path=str(tmp_path / "base"),
        forward_only=True,
    )
    assert any(".adapter." in n for n, _ in eng.chunks[0].named_parameters())
    stream, _ = eng.get_per_tensor_param(base_sync_done=False)
    exported = {k: v.cpu() for k, v in stream}
    for name, tensor in (
        AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).state_dict().items()
    ):
        assert torch.equal(exported[name], tensor), name


def test_value_model_trains_adapters_and_its_head(megatron_env, tiny_qwen2):
    eng = make_lora_engine(tiny_qwen2, cls_name="MegatronValueModelEngine")
    trainable = sorted(n for n, p in eng.chunks[0].named_parameters() if p.requires_grad)
    assert trainable and all(".adapter." in n or ".output_layer." in n for n in trainable)
    assert any(".output_layer." in n for n in trainable)


def test_target_and_exclude_modules_map_to_megatron_linears(megatron_env, tiny_qwen2):
    eng = make_lora_engine(
        tiny_qwen2,
        model_kw=dict(
            target_modules=["q_proj", "down_proj"], exclude_modules=["model.layers.1.mlp.down_proj"]
        ),
        forward_only=True,
    )
    adapted = sorted(
        n.rsplit(".adapter.", 1)[0] for n, _ in eng.chunks[0].named_parameters() if ".adapter." in n
    )
    assert sorted(set(adapted)) == [
        "decoder.layers.0.mlp.linear_fc2",
        "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.1.self_attention.linear_qkv",
    ]
    config = eng.get_per_tensor_param(base_sync_done=True)[1]
    assert config["target_modules"] == [  # q_proj adapts the fused QKV, so k and v are adapted too
        "model.layers.0.mlp.down_proj",
        *(f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kqv"),
    ]


def test_selecting_no_linear_is_a_value_error(megatron_env, tiny_qwen2):
    with pytest.raises(ValueError, match="selects no linear layer"):
        make_lora_engine(
            tiny_qwen2,
            model_kw=dict(target_modules=["q_proj"], exclude_modules=["q_proj"]),
            forward_only=True,
        )


@pytest.fixture(scope="module")
def two_rank_results(tiny_qwen2, tmp_path_factory):
    """``lora_worker.py`` on 2 gloo ranks: TP=2 with sequence parallelism, PP=2 (one layer per stage), PP=2
    with adapters in the second stage only."""
    out = tmp_path_factory.mktemp("lora_dist")
    torchrun(Path(__file__).with_name("lora_worker.py"), tiny_qwen2, out)
    results = {}
    for rank in (0, 1):
        results.update(json.loads((out / f"results_rank{rank}.json").read_text()))
    return results


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout, layers, trained_ranks",
    [("tp2", [0, 1], [0, 1]), ("pp2", [0, 1], [0, 1]), ("pp2_idle_stage", [1], [1])],
)
def test_two_rank_lora_equals_hf_peft(two_rank_results, layout, layers, trained_ranks):
    """Sharded (TP) or staged (PP) adapters, after one training step: the gathered adapter stream and peft
    config load into peft and give the engine's log-probs; the merged stream equals ``merge_and_unload``;
    every rank streams the same. ``pp2_idle_stage`` adapts only layer 1, so the first pipeline stage has
    nothing to train and still steps with the second (Megatron-Core's first grad clipping ran a collective
    only where there were parameters, and hung, until ``build_optimizer`` ran it on every rank)."""
    results = two_rank_results[layout]
    assert results["adapter_layers"] == layers  # every stage's adapters are in the stream
    assert results["ranks_with_trainable_params"] == trained_ranks
    assert results["same_streams_on_all_ranks"]
    assert results["adapter_effect"] > 1e-3  # B starts at zero: the step trained the adapter
    assert results["logprob_maxdiff"] < 1e-5
    assert results["base_logprob_maxdiff"] < 1e-5
    assert results["merged_names_equal"] and results["merged_maxdiff"] < 1e-6
