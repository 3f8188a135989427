"""Packed attention's compute dtype and its fallback decision: a one-process engine (fp32 module under
autocast) hands attention the same q/k/v dtype as FSDP2 with one rank, and the per-sequence loop is never
taken on CUDA without a warning that names the cause and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from fsdp_testing import AttentionCalls, make_batch, make_engine, one_rank_group, pg_loss, save_tiny_model

from posttrain.fsdp import attention

LENGTHS = [20, 9, 33, 4]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("lm") / "model")


def bf16_step(path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[AttentionCalls, list[float], torch.Tensor]:
    """A bf16 train step and forward; the returned counts cover this engine's calls only."""
    monkeypatch.undo()  # drop an earlier run's counting wrappers
    calls = AttentionCalls(monkeypatch)
    eng = make_engine(path, dtype="bfloat16")
    batch = make_batch(LENGTHS)
    with eng.train_mode():
        loss = eng.train_batch(batch, pg_loss)["loss"]
    with eng.eval_mode():
        log_probs = eng.infer_batch(batch)["model_output"]["log_probs"]
    return calls, loss, log_probs


def test_one_process_attends_in_the_dtype_of_one_rank_fsdp2(
    lm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, loss1, lp1 = bf16_step(lm_dir, monkeypatch)
    with one_rank_group("gloo"):
        fsdp, loss2, lp2 = bf16_step(lm_dir, monkeypatch)
    assert fsdp.dtypes == {(torch.bfloat16,) * 3}
    assert one.dtypes == fsdp.dtypes, "without a process group q/k must leave RoPE in the compute dtype"
    assert one.calls["per_sequence"] > 0  # CPU: the per-sequence loop is the implementation
    # fp32 residual stream (autocast) vs bf16 everywhere (FSDP2 mixed precision): equal up to bf16 rounding
    torch.testing.assert_close(loss1, loss2, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lp1, lp2, atol=0.1, rtol=0)


def test_fallback_reason_names_cause_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert attention.fallback_reason(cpu, torch.float32) is None
    assert attention.fallback_reason(cpu, torch.bfloat16) is None
    assert attention.fallback_reason(cuda, torch.bfloat16) is None  # torch 2.14 has the varlen kernel
    reason = attention.fallback_reason(cuda, torch.float32)
    assert "torch.float32" in reason and "engine.dtype=bfloat16" in reason
    monkeypatch.setitem(attention._VARLEN_API, "api", None)  # a torch without torch.nn.attention.varlen
    reason = attention.fallback_reason(cuda, torch.bfloat16)
    assert "torch.nn.attention.varlen" in reason and "torch >= 2.10" in reason


def test_fallback_warns_once_per_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            attention._warn_fallback("cause one: fix one")
        attention._warn_fallback("cause two: fix two")
    assert [str(w.message) for w in seen] == ["cause one: fix one", "cause two: fix two"]
    assert all(w.category is RuntimeWarning for w in seen)


def test_cpu_fallback_is_silent(lm_dir: str) -> None:
    eng = make_engine(lm_dir, dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with eng.eval_mode():
            eng.infer_batch(make_batch(LENGTHS))
