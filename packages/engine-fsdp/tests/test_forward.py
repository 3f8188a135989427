"""Single-process numerics: packed log-probs / entropy / values equal a Hugging Face forward on each sequence,
and packing, padding, micro-batching, chunking and checkpointing all give the same loss and gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_testing import (
    full_grads,
    hf_reference,
    make_batch,
    make_engine,
    pg_loss,
    save_tiny_model,
    value_loss,
)

from posttrain.core.config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig

LENGTHS = [5, 9, 3, 17, 1, 12]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("lm") / "model")


@pytest.fixture(scope="module")
def value_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("value") / "model", value_model=True, tie=False)


def test_log_probs_and_entropy_match_hf(lm_dir: str) -> None:
    batch = make_batch(LENGTHS)
    eng = make_engine(lm_dir, entropy_from_logits_chunk_size=7)
    with eng.eval_mode():
        got = eng.infer_batch(batch)["model_output"]
    want = hf_reference(lm_dir, batch)
    torch.testing.assert_close(got["log_probs"].double(), want["log_probs"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["entropy"].double(), want["entropy"], atol=1e-5, rtol=0)
    starts = batch.cu_seqlens[:-1].long()
    assert bool((got["log_probs"][starts] == 0).all())


def test_token_accuracy_matches_hf_argmax(lm_dir: str) -> None:
    """``correct`` (batch.meta['calculate_accuracy']) is HF's float64 argmax == token, token by token, over
    several logits chunks and micro-batches, with gradients on (the training path) and off."""
    from transformers import AutoModelForCausalLM

    from posttrain.core.batch import PackedBatch
    from posttrain.core.testing import argmax_hits, half_greedy_sequences

    hf = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()
    seqs = half_greedy_sequences(hf, LENGTHS[:4] + [20, 16])
    want = argmax_hits(hf, seqs)
    assert 0.3 < float(want.sum()) / (want.numel() - len(seqs)) < 0.8  # neither all hits nor none
    masks = [torch.ones(len(s)) for s in seqs]
    batch = PackedBatch.from_sequences(seqs, masks, meta={"calculate_accuracy": True})
    eng = make_engine(lm_dir, entropy_from_logits_chunk_size=7, micro_batch_size_per_gpu=2)
    assert eng.computes_token_accuracy
    with eng.eval_mode():
        inferred = eng.infer_batch(batch)["model_output"]
    with eng.train_mode():
        eng.optimizer_zero_grad()
        trained = eng.forward_backward_batch(batch, pg_loss_without_advantages)["model_output"]
    for got in (inferred, trained):
        assert "entropy" not in got
        torch.testing.assert_close(got["correct"].double(), want, atol=0, rtol=0)


def pg_loss_without_advantages(out, mb, ctx):
    return -(out["log_probs"] * mb.loss_mask).sum() / ctx.global_num_tokens * ctx.dp_size, {}


def test_values_match_hf(value_dir: str) -> None:
    batch = make_batch(LENGTHS)
    eng = make_engine(value_dir, value_model=True)
    with eng.eval_mode():
        got = eng.infer_batch(batch)["model_output"]
    torch.testing.assert_close(
        got["values"].double(), hf_reference(value_dir, batch, True)["values"], atol=1e-5, rtol=0
    )


def run_backward(path: str, batch, value_model: bool = False, model: dict | None = None, **engine):
    eng = make_engine(path, value_model=value_model, model=model, **engine)
    with eng.train_mode():
        eng.optimizer_zero_grad()
        out = eng.forward_backward_batch(batch, value_loss if value_model else pg_loss)
        return sum(out["loss"]), out["model_output"], full_grads(eng), len(out["loss"])


VARIANTS = {
    "padded": ({"use_remove_padding": False}, 1),
    "dynamic_bsz": ({"max_token_len_per_gpu": 18}, 3),
    "count_micro_batches": ({"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}, 3),
    "pad_to_bucket_chunked": (
        {"pad_to_length": True, "pad_to_length_bucket": 16, "entropy_from_logits_chunk_size": 5},
        1,
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layouts_give_same_loss_and_grads(lm_dir: str, variant: str) -> None:
    """Against one packed micro-batch without checkpointing; each variant runs with checkpointing on."""
    batch = make_batch(LENGTHS)
    ref_loss, ref_out, ref_grads, _ = run_backward(
        lm_dir, batch, model={"enable_gradient_checkpointing": False}
    )
    engine, num_micro = VARIANTS[variant]
    loss, out, grads, n = run_backward(lm_dir, batch, **engine)
    assert n == num_micro
    assert abs(loss - ref_loss) < 1e-6
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(out[key], ref_out[key], atol=1e-6, rtol=0)
    assert sorted(grads) == sorted(ref_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_value_model_padded_equals_packed(value_dir: str) -> None:
    batch = make_batch(LENGTHS)
    ref = run_backward(value_dir, batch, value_model=True)
    got = run_backward(value_dir, batch, value_model=True, use_remove_padding=False, max_token_len_per_gpu=20)
    assert abs(got[0] - ref[0]) < 1e-6
    torch.testing.assert_close(got[1]["values"], ref[1]["values"], atol=1e-6, rtol=0)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], atol=1e-6, rtol=1e-5, msg=name)


def test_bad_inputs_name_the_fix(lm_dir: str, tmp_path: Path) -> None:
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    eng = make_engine(lm_dir)
    batch = make_batch([4, 5])
    batch.fields["temperature"][:] = 0.0
    with pytest.raises(ValueError, match="temperature"):
        eng.infer_batch(batch)
    with pytest.raises(ValueError, match="loss_fn"):
        eng.forward_backward_batch(make_batch([4, 5]), None, forward_only=False)
    with pytest.raises(ValueError, match="FSDPEngineConfig"):
        FSDPLanguageModelEngine(
            ModelConfig(path=lm_dir),
            EngineConfig(strategy="megatron"),
            OptimizerConfig(),
            CheckpointConfig(),
        )
    with pytest.raises(ValueError, match="config.json"):
        make_engine(str(tmp_path))
