"""Single-process training behaviour: step skipping, clipping, LR schedule, offload, LoRA streams and the
adapter switch, the plain weight stream, random init from a config, and registry lookup."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fsdp_testing import (
    full_params,
    make_batch,
    make_engine,
    pg_loss,
    save_tiny_adapter,
    save_tiny_model,
    tiny_config,
    value_loss,
)

from posttrain.core.batch import PackedBatch


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("lm") / "model")


@pytest.fixture(scope="module")
def adapter_dir(lm_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_adapter(lm_dir, tmp_path_factory.mktemp("adapter") / "adapter")


def snapshot(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def test_non_finite_grad_skips_the_step(lm_dir: str) -> None:
    eng = make_engine(lm_dir)
    before = snapshot(eng)

    def nan_loss(out, mb, ctx):
        loss, metrics = pg_loss(out, mb, ctx)
        return loss * float("nan"), metrics

    with eng.train_mode():
        metrics = eng.train_batch(make_batch([6, 9]), nan_loss)["metrics"]
    assert not math.isfinite(metrics["grad_norm"]) and metrics["skipped_step"] == 1.0
    assert eng.skipped_steps == 1
    for name, p in eng.module.named_parameters():
        assert torch.equal(p, before[name]), name
    assert not eng.optimizer.state  # AdamW never ran


def test_skipped_steps_in_a_row_stop_the_run_naming_the_tensor(lm_dir: str) -> None:
    from posttrain.core.engine import NonFiniteTrainingError

    eng = make_engine(lm_dir)  # optim.max_skipped_steps_in_a_row defaults to 3

    def nan_loss(out, mb, ctx):
        loss, metrics = pg_loss(out, mb, ctx)
        return loss * float("nan"), metrics

    with eng.train_mode():
        for loss in (nan_loss, nan_loss, pg_loss, nan_loss, nan_loss):  # a finite step resets the streak
            eng.train_batch(make_batch([6, 9]), loss)
        assert eng.skipped_steps == 4 and eng.skipped_in_a_row == 2
        with pytest.raises(NonFiniteTrainingError, match=r"3 optimizer steps in a row .*gradient of model\."):
            eng.train_batch(make_batch([6, 9]), nan_loss)


def test_clipping_scales_to_clip_grad(lm_dir: str) -> None:
    eng = make_engine(lm_dir, clip_grad=1e-3)
    with eng.train_mode(disable_auto_offload=True):
        eng.forward_backward_batch(make_batch([6, 9, 4]), pg_loss)
        norm = eng.clip_grad_norm()
        clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in eng.module.parameters() if p.grad is not None))
    assert norm > 1e-3
    assert abs(float(clipped) - 1e-3) < 1e-8


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_lr_schedule_follows_the_config(lm_dir: str) -> None:
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.fsdp.config import FSDPEngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    oc = OptimizerConfig(
        lr=1e-3, lr_warmup_steps=2, total_training_steps=6, lr_decay_style="cosine", min_lr=1e-4
    )
    eng = FSDPLanguageModelEngine(
        ModelConfig(path=lm_dir), FSDPEngineConfig(dtype="fp32"), oc, CheckpointConfig()
    )
    eng.initialize()
    lrs = [eng.lr_scheduler_step() for _ in range(5)]
    assert lrs == pytest.approx([1e-3 * oc.lr_multiplier(s) for s in range(1, 6)], rel=1e-12)


def test_offload_round_trip_and_offloaded_training_are_bit_identical(lm_dir: str) -> None:
    batch = make_batch([6, 9, 4])
    plain = make_engine(lm_dir)
    offl = make_engine(lm_dir, param_offload=True, optimizer_offload=True, grad_offload=True)
    for _ in range(2):
        for eng in (plain, offl):
            with eng.train_mode():
                eng.train_batch(batch, pg_loss)
    assert all(p.device.type == "cpu" for p in offl.module.parameters())
    params, state = (
        snapshot(offl),
        {k: {n: v.clone() for n, v in s.items()} for k, s in offl.optimizer.state.items()},
    )
    offl.to("cpu")
    offl.to(offl.device)
    for name, p in offl.module.named_parameters():
        assert torch.equal(p, params[name]) and torch.equal(p, dict(plain.module.named_parameters())[name]), (
            name
        )
    for key, s in offl.optimizer.state.items():
        for n, v in s.items():
            assert torch.equal(v.cpu(), state[key][n].cpu()), n


def test_plain_stream_has_hf_names_in_rollout_dtype(lm_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    eng = make_engine(lm_dir)
    with pytest.raises(TypeError, match="layered_summon"):  # the contract's keywords only, none swallowed
        eng.get_per_tensor_param(layered_summon=True)
    stream, peft_cfg = eng.get_per_tensor_param(dtype="bfloat16")
    got = dict(stream)
    want = AutoModelForCausalLM.from_pretrained(lm_dir).state_dict()
    assert peft_cfg is None and sorted(got) == sorted(k for k in want if k != "lm_head.weight")
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name].to(torch.bfloat16)), name


def test_lora_streams_and_adapter_switch(lm_dir: str, adapter_dir: str) -> None:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    eng = make_engine(lm_dir, model={"lora_adapter_path": adapter_dir})
    assert eng.is_lora
    assert all(".lora_" in n for n, p in eng.module.named_parameters() if p.requires_grad)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lm_dir), adapter_dir)
    adapter_want = get_peft_model_state_dict(peft_model)
    merged_want = peft_model.merge_and_unload().state_dict()
    merged, cfg = eng.get_per_tensor_param(peft_merge=True, dtype=torch.float32)
    merged = dict(merged)
    assert cfg is None and sorted(merged) == sorted(k for k in merged_want if k != "lm_head.weight")
    for name, t in merged.items():
        torch.testing.assert_close(t, merged_want[name], atol=1e-6, rtol=0, msg=name)
    adapter, cfg = eng.get_per_tensor_param(base_sync_done=True, dtype=torch.float32)
    adapter = dict(adapter)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and json.dumps(cfg)
    assert sorted(adapter) == sorted(adapter_want)
    for name, t in adapter.items():
        assert torch.equal(t, adapter_want[name]), name
    base, _ = eng.get_per_tensor_param(base_sync_done=False, dtype=torch.float32)
    base_want = AutoModelForCausalLM.from_pretrained(lm_dir).state_dict()
    assert all(torch.equal(t, base_want[n]) for n, t in base)
    batch = make_batch([7, 5])
    plain = make_engine(lm_dir)
    with eng.eval_mode(), plain.eval_mode():
        lora_lp = eng.infer_batch(batch)["model_output"]["log_probs"]
        with eng.disable_adapter():
            base_lp = eng.infer_batch(batch)["model_output"]["log_probs"]
        plain_lp = plain.infer_batch(batch)["model_output"]["log_probs"]
    torch.testing.assert_close(base_lp, plain_lp, atol=1e-6, rtol=0)
    assert float((lora_lp - base_lp).abs().max()) > 1e-3


def test_fresh_lora_trains_only_the_adapter(lm_dir: str) -> None:
    eng = make_engine(
        lm_dir, model={"lora_rank": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}, lr=1e-2
    )
    base_before = dict(eng.get_per_tensor_param(dtype=torch.float32)[0])
    with eng.train_mode():
        eng.train_batch(make_batch([6, 9]), pg_loss)
        eng.train_batch(make_batch([6, 9]), pg_loss)
    after = full_params(eng)
    assert all(torch.equal(after[n], t) for n, t in base_before.items())
    assert any(float(t.abs().max()) > 0 for n, t in after.items() if "lora_B" in n)


def test_config_only_random_init_is_seeded(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    a, b = make_engine(str(tmp_path)), make_engine(str(tmp_path))
    c = make_engine(str(tmp_path), seed=7)
    pa, pb, pc = full_params(a), full_params(b), full_params(c)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert any(not torch.equal(pa[n], pc[n]) for n in pa)
    with a.eval_mode():
        out = a.infer_batch(PackedBatch.from_sequences([[1, 2, 3]]))["model_output"]["log_probs"]
    assert out.shape == (3,) and bool(torch.isfinite(out).all())


def test_value_engine_from_a_causal_lm_checkpoint_initialises_its_head(lm_dir: str) -> None:
    eng = make_engine(lm_dir, value_model=True)
    with eng.eval_mode():
        values = eng.infer_batch(make_batch([4, 6]))["model_output"]["values"]
    assert values.shape == (10,) and bool(torch.isfinite(values).all())
    assert float(eng.module.score.weight.detach().abs().max()) > 0


def test_value_model_lora_trains_adapter_and_head(lm_dir: str) -> None:
    eng = make_engine(lm_dir, value_model=True, model={"lora_rank": 2})
    trainable = {n for n, p in eng.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".score." in n for n in trainable)
    assert any(".score." in n for n in trainable)
    head = eng.module.base_model.model.score.weight.detach().clone()
    with eng.train_mode():
        eng.train_batch(make_batch([6, 9]), value_loss)
    assert not torch.equal(head, eng.module.base_model.model.score.weight.detach())


def test_registry_finds_both_variants_and_their_engines() -> None:
    from posttrain.core.config import engine_config_class
    from posttrain.fsdp.config import FSDP1EngineConfig, FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine, FSDPValueModelEngine

    for backend, cls in (("fsdp", FSDP1EngineConfig), ("fsdp2", FSDP2EngineConfig)):
        assert engine_config_class(backend) is cls and cls().strategy == backend
        assert cls().engine_class("language_model") is FSDPLanguageModelEngine
        assert cls().engine_class("value_model") is FSDPValueModelEngine
