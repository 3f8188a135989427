"""CUDA-only checks (run on the GPU machine): the variable-length attention kernel against per-sequence SDPA,
bf16 engine log-probs against an fp32 HF forward, a one-process engine against FSDP2 with one rank (the varlen
path, no fallback), the fp32 fallback's warning, the fused RMSNorm's CUDA kernels, and offload to host memory
and back."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from fsdp_testing import (
    AttentionCalls,
    make_batch,
    make_engine,
    one_rank_group,
    pg_loss,
    save_tiny_model,
    train_step,
)

from posttrain.core.testing import torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_attention_equals_per_sequence_sdpa(kv_heads: int) -> None:
    from posttrain.fsdp.attention import _per_sequence, _varlen, varlen_available

    assert varlen_available(torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    lens = [5, 130, 1, 77, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lens)
    q = torch.randn(1, 8, total, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, total, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, total, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = _varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, max(lens), 0.125)
    want = _per_sequence(q.float(), k.float(), v.float(), cu.tolist(), 0.125, 0.0)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    (got.float() * want.detach()).sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


def test_bf16_log_probs_close_to_fp32_hf(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "lm")
    batch = make_batch([40, 200, 9, 130])
    eng = make_engine(path, dtype="bfloat16")
    with eng.eval_mode():
        got = eng.infer_batch(batch)["model_output"]["log_probs"]
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    temps = batch.split_tokens(batch.fields["temperature"])
    with torch.no_grad():
        for ids, temp, lp in zip(batch.split_tokens(batch.input_ids), temps, batch.split_tokens(got)):
            logp = torch.log_softmax(model(ids.cuda()[None]).logits[0].float() / temp[0], -1)
            want = logp[:-1].gather(-1, ids.cuda()[1:, None])[:, 0].cpu()
            torch.testing.assert_close(lp[1:], want, atol=5e-2, rtol=0)


def test_one_process_takes_varlen_and_matches_one_rank_fsdp2(tmp_path, monkeypatch) -> None:
    """No process group (fp32 module under autocast) vs torchrun-style FSDP2 with one rank (bf16 mixed
    precision): both run every packed attention call through the varlen kernel in bf16, and one train step
    gives the same loss, log-probs, gradients and updated params up to bf16 rounding."""
    path = save_tiny_model(tmp_path / "lm")
    batch = make_batch([40, 200, 9, 130])
    runs = {}
    for name, group in (("one_process", contextlib.nullcontext()), ("fsdp2", one_rank_group("nccl"))):
        monkeypatch.undo()  # count this engine's calls only
        calls = AttentionCalls(monkeypatch)
        with group:
            eng = make_engine(path, dtype="bfloat16")
            assert type(eng.layout).__name__ == ("FSDP2Layout" if name == "fsdp2" else "PlainLayout")
            step = train_step(eng, batch, pg_loss)
        assert calls.calls["per_sequence"] == 0 and calls.calls["varlen"] > 0, (name, calls.calls)
        assert calls.dtypes == {(torch.bfloat16,) * 3}, (name, calls.dtypes)
        runs[name] = step
    one, fsdp = runs["one_process"], runs["fsdp2"]
    torch.testing.assert_close(one["loss"], fsdp["loss"], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(one["output"]["log_probs"], fsdp["output"]["log_probs"], atol=0.1, rtol=0)
    g1 = torch.cat([one["grads"][k].flatten().float() for k in sorted(fsdp["grads"])])
    g2 = torch.cat([fsdp["grads"][k].flatten().float() for k in sorted(fsdp["grads"])])
    assert float((g1 - g2).norm() / g2.norm()) < 3e-2
    for name in fsdp["params"]:  # one Adam step moves a param by ~lr = 1e-4
        torch.testing.assert_close(one["params"][name], fsdp["params"][name], atol=3e-4, rtol=0, msg=name)


def test_fp32_packed_attention_on_cuda_warns_once(tmp_path, monkeypatch) -> None:
    from posttrain.fsdp import attention

    monkeypatch.setattr(attention, "_WARNED", set())
    eng = make_engine(save_tiny_model(tmp_path / "lm"))  # fp32 compute: no varlen kernel
    with pytest.warns(RuntimeWarning, match="engine.dtype=bfloat16") as record:
        with eng.eval_mode():
            for _ in range(2):
                eng.infer_batch(make_batch([40, 9]))
    assert sum("engine.dtype=bfloat16" in str(w.message) for w in record) == 1


def test_compiled_layers_equal_eager(tmp_path) -> None:
    """``compile_layers`` (bf16, varlen attention inside the compiled graph): the same log-probs, losses and
    updated params as eager up to bf16 rounding, over two packed lengths (one dynamic graph serves both).

    The params' bound comes from Adam: whatever the gradient, one step moves an element by at most about
    ``lr`` (``m / sqrt(v)`` is within [-1, 1] on the first step and close to it after), so an element whose
    tiny gradient rounds to the other sign under compilation lands up to ``2 * lr`` away per step:
    ``2 * lr * steps`` bounds a rounding-flipped update. Such flips are rare; a wrong compiled gradient moves
    most elements, so the mean difference must also stay far below ``lr``."""
    path = save_tiny_model(tmp_path / "lm")
    lr = 1e-4
    runs = {}
    for compiled in (False, True):
        eng = make_engine(path, dtype="bfloat16", compile_layers=compiled, lr=lr)
        layers = eng.module.model.layers
        assert all((getattr(m, "_compiled_call_impl", None) is not None) == compiled for m in layers)
        start = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
        batches = [make_batch([40, 200, 9, 130]), make_batch([70, 11])]
        with eng.train_mode():
            losses = [eng.train_batch(b, pg_loss)["loss"] for b in batches]
        with eng.eval_mode():
            lp = eng.infer_batch(batches[0])["model_output"]["log_probs"]
        params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
        runs[compiled] = (losses, lp, params, start)
    (l0, lp0, p0, s0), (l1, lp1, p1, s1) = runs[False], runs[True]
    diffs = torch.cat([(p1[n].float() - p0[n].float()).abs().flatten() for n in p0])
    moved = torch.cat([(p0[n].float() - s0[n].float()).abs().flatten() for n in p0])
    stats = (
        f"losses {l0} vs {l1}; log-prob max diff {(lp1 - lp0).abs().max():.3e}; param diff max "
        f"{diffs.max():.3e} mean {diffs.mean():.3e}, {(diffs > lr / 2).float().mean():.2e} of elements past "
        f"lr/2; eager moved params by {moved.mean():.3e} on average"
    )
    print(stats)
    for n in s0:
        assert torch.equal(s0[n], s1[n]), f"{n}: both runs must start from the same weights"
    torch.testing.assert_close(l1, l0, atol=2e-2, rtol=2e-2, msg=stats)
    torch.testing.assert_close(lp1, lp0, atol=5e-2, rtol=0, msg=stats)
    assert diffs.max() <= 2 * lr * len(batches) * 1.05, stats
    assert diffs.mean() <= 0.05 * lr, stats


def _norm_ops(norm: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[list, list[str]]:
    """(output, input grad, weight grad) of one forward and backward, and the ATen ops they ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    names: list[str] = []
    xi = x.clone().requires_grad_()
    with Ops():
        out = norm(xi)
        out.backward(grad)
    return [out, xi.grad, norm.weight.grad], names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_is_one_cuda_kernel_each_way(dtype: torch.dtype) -> None:
    """``FusedRMSNorm`` on CUDA runs ``_fused_rms_norm`` forward and ``_fused_rms_norm_backward`` backward
    (plus the weight multiply), none of HF's pow/mean/rsqrt, and gives HF's ``Qwen3RMSNorm`` results up to the
    fused kernel's fp32 summation order (a bf16 rounding step at most)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from posttrain.fsdp.norms import FusedRMSNorm

    hf = Qwen3RMSNorm(2048, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    fused = FusedRMSNorm(torch.nn.Parameter(hf.weight.detach().clone()), hf.variance_epsilon)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(4096, 2048, device="cuda", generator=gen)).to(dtype)
    grad = torch.randn(4096, 2048, device="cuda", generator=gen).to(dtype)
    want, hf_ops = _norm_ops(hf, x, grad)
    got, ops = _norm_ops(fused, x, grad)
    assert {"_fused_rms_norm", "_fused_rms_norm_backward"} <= set(ops), ops
    assert not {"pow", "mean", "rsqrt"} & set(ops), ops
    assert len(ops) < len(hf_ops), (ops, hf_ops)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, w, g in zip(("output", "input grad", "weight grad"), want, got):
        assert g.dtype == w.dtype
        scale = float(w.float().abs().max())
        torch.testing.assert_close(g.float(), w.float(), atol=tol * scale, rtol=tol, msg=name)


def test_offload_to_host_and_back_is_bit_identical(tmp_path) -> None:
    path = save_tiny_model(tmp_path / "lm")
    eng = make_engine(path, dtype="bfloat16")
    with eng.train_mode():
        eng.train_batch(make_batch([30, 50]), pg_loss)
    params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in eng.optimizer.state.items()}
    eng.to("cpu")
    assert all(p.device.type == "cpu" for p in eng.module.parameters())
    assert all(
        v.device.type == "cpu" for s in eng.optimizer.state.values() for v in s.values() if v.dim() > 0
    )
    eng.to(eng.device)
    for n, p in eng.module.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p, params[n]), n
    for p, s in eng.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k
    with eng.train_mode():
        metrics = eng.train_batch(make_batch([30, 50]), pg_loss)["metrics"]
    assert metrics["skipped_step"] == 0.0


@pytest.mark.dist
def test_fsdp2_under_nccl(tmp_path) -> None:
    """One process per GPU (at most two): see gpu_worker.py for what each rank checks."""
    path = save_tiny_model(tmp_path / "lm")
    nproc = min(2, torch.cuda.device_count())
    proc = torchrun(Path(__file__).with_name("gpu_worker.py"), path, nproc=nproc, timeout=600)
    assert proc.stdout.count(": ok") == nproc
