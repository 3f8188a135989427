"""``engine.fused_rms_norm``: :class:`FusedRMSNorm` is HF's RMSNorm (forward and backward, bitwise on a CPU)
for every model type it is swapped into, and a Qwen3 engine with it gives HF's log-probs and the loss and
gradients of the same engine with HF's modules."""

from __future__ import annotations

import importlib

import pytest
import torch
from fsdp_testing import VOCAB, full_grads, hf_reference, make_batch, make_engine, pg_loss

from posttrain.fsdp.norms import FUSED_RMS_NORM_CLASSES, FusedRMSNorm, fuse_rms_norms

LENGTHS = [5, 9, 3, 17, 1, 12]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Qwen3 (q/k norms on the heads), tied embeddings, saved as an HF directory."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512,
                      tie_word_embeddings=True, rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norm weights away from 1, so a swapped weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("qwen3") / "model"
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("model_type", sorted(FUSED_RMS_NORM_CLASSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_is_hf_norm(model_type: str, dtype: torch.dtype) -> None:
    """Output, input gradient and weight gradient bitwise equal to the installed transformers' class."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    hf = getattr(module, FUSED_RMS_NORM_CLASSES[model_type])(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    fused = FusedRMSNorm(torch.nn.Parameter(hf.weight.detach().clone()), hf.variance_epsilon)
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 7, 64, generator=gen)).to(dtype)
    grad = torch.randn(4, 7, 64, generator=gen).to(dtype)
    outs = []
    for norm in (hf, fused):
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        outs.append((out, xi.grad, norm.weight.grad))
    for want, got in zip(*outs):
        assert want.dtype == got.dtype and torch.equal(want, got)


def test_fused_norm_under_autocast_rounds_like_hf() -> None:
    """fp32 weight, bf16 input under CPU autocast (the one-process engine's bf16 compute): HF's result."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hf = Qwen3RMSNorm(64, eps=1e-6)
    fused = FusedRMSNorm(hf.weight, hf.variance_epsilon)
    x = torch.randn(5, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = hf(x), fused(x)
    assert want.dtype == got.dtype == torch.float32 and torch.equal(want, got)


def test_unknown_model_type_is_left_alone() -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    model = torch.nn.Sequential(Qwen3RMSNorm(8))
    assert fuse_rms_norms(model, "gemma") == 0
    assert type(model[0]) is Qwen3RMSNorm
    assert fuse_rms_norms(model, "qwen3") == 1
    assert type(model[0]) is FusedRMSNorm and model[0].weight.shape == (8,)


def _norm_types(eng) -> set[str]:
    return {type(m).__name__ for m in eng._hf_model.modules() if "RMSNorm" in type(m).__name__}


def _step(eng, batch) -> tuple[float, dict, dict]:
    with eng.train_mode():
        eng.optimizer_zero_grad()
        out = eng.forward_backward_batch(batch, pg_loss)
        return sum(out["loss"]), out["model_output"], full_grads(eng)


def test_qwen3_engine_fused_equals_hf_modules(qwen3_dir: str, capsys: pytest.CaptureFixture) -> None:
    """Default (fused) against ``fused_rms_norm=false``: the same loss, log-probs, entropy and every gradient;
    the fused engine's log-probs equal HF's own per-sequence forward."""
    batch = make_batch(LENGTHS)
    fused = make_engine(qwen3_dir, entropy_from_logits_chunk_size=7)
    assert "engine.fused_rms_norm: 9 Qwen3RMSNorm modules -> FusedRMSNorm" in capsys.readouterr().err
    hf = make_engine(qwen3_dir, entropy_from_logits_chunk_size=7, fused_rms_norm=False)
    assert _norm_types(fused) == {"FusedRMSNorm"} and _norm_types(hf) == {"Qwen3RMSNorm"}
    with fused.eval_mode():
        inferred = fused.infer_batch(batch)["model_output"]
    want = hf_reference(qwen3_dir, batch)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(inferred[key].double(), want[key], atol=1e-5, rtol=0)
    (loss, out, grads), (ref_loss, ref_out, ref_grads) = _step(fused, batch), _step(hf, batch)
    assert loss == ref_loss
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(out[key], ref_out[key], atol=0, rtol=0)
    assert sorted(grads) == sorted(ref_grads) and any(".q_norm." in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=0, rtol=0, msg=name)


def test_qwen3_engine_bf16_autocast_equals_hf_modules(qwen3_dir: str) -> None:
    """bf16 compute over fp32 master weights in one process (autocast): fused and HF modules agree bitwise."""
    batch = make_batch(LENGTHS)
    results = [
        _step(make_engine(qwen3_dir, dtype="bfloat16", fused_rms_norm=fused), batch)
        for fused in (True, False)
    ]
    (loss, out, grads), (ref_loss, ref_out, ref_grads) = results
    assert loss == ref_loss
    torch.testing.assert_close(out["log_probs"], ref_out["log_probs"], atol=0, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=0, rtol=0, msg=name)
