"""Two gloo ranks (one torchrun launch) equal one process: an FSDP2 step, each rank on part of the batch
(unequal micro-batch counts), gives the single-process step's weights and grad norm; so does a TP=2 step
(tensor parallelism over both ranks, the whole batch on each), with the same loss and log-probs. The 2-rank
FSDP2 checkpoint resumes in one process on the FSDP engine (N -> M ranks, across backends). fp32 throughout:
rtol 1e-5 (atol 1e-6 on weights, 1e-5 on log-probs), the summation-order noise of gloo's all-reduce and the TP
matmul split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_worker import LENGTHS, _step_with_grads
from test_moe import MOE
from titan_testing import make_batch, make_engine, save_tiny_model
from transformers import AutoModelForCausalLM

from posttrain.core.testing import argmax_hits, half_greedy_sequences, torchrun

pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo CPU exactness test"),
]


def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model")
    ref = make_engine(str(tmp_path / "model"), max_token_len_per_gpu=16)
    with ref.eval_mode():
        log_probs = ref.infer_batch(make_batch(LENGTHS))["model_output"]["log_probs"]
    ref_grads: dict = {}
    with ref.train_mode():
        metrics = _step_with_grads(ref, make_batch(LENGTHS), ref_grads)["metrics"]
    want = dict(ref.get_per_tensor_param()[0])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    # token accuracy under TP: HF's float64 argmax, token by token
    seqs = half_greedy_sequences(hf, [9, 14, 6])
    torch.save(seqs, tmp_path / "acc_seqs.pt")
    torchrun(Path(__file__).with_name("dist_worker.py"), tmp_path, "fsdp2", "tp", timeout=600)
    tp = torch.load(tmp_path / "tp.pt")
    assert (tp["dp"], tp["src"]) == (1, True)
    torch.testing.assert_close(tp["log_probs"], log_probs, rtol=1e-5, atol=1e-5)
    hits = argmax_hits(hf, seqs)
    assert 0 < float(hits.sum()) < hits.numel() - len(seqs)
    torch.testing.assert_close(tp["correct"].double(), hits, atol=0, rtol=0)
    assert tp["loss"] == pytest.approx(metrics["pg_loss"], rel=1e-5)
    assert set(tp["grads"]) == set(ref_grads["grads"])
    for name, value in ref_grads["grads"].items():
        torch.testing.assert_close(tp["grads"][name], value, rtol=1e-5, atol=1e-6, msg=f"tp grad {name}")
    # AdamW's first step moves each weight by about lr * sign(grad): gradients at the noise floor flip it, so
    # the TP weights get atol 1e-5 (lr 1e-3).
    for case, atol in (("fsdp2", 1e-6), ("tp", 1e-5)):
        got = torch.load(tmp_path / f"{case}.pt")
        assert got["norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        assert set(got["params"]) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=atol, msg=f"{case} {name}")

    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    fsdp = FSDPLanguageModelEngine(
        ModelConfig(path=str(tmp_path / "model")),
        FSDP2EngineConfig(dtype="fp32"),
        OptimizerConfig(lr=1e-3),
        CheckpointConfig(),
    )
    fsdp.initialize()
    fsdp.load_checkpoint(str(tmp_path / "ckpt" / "global_step_1" / "actor"))
    loaded = dict(fsdp.get_per_tensor_param()[0])
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert fsdp.optimizer.state  # the AdamW moments came back too


def test_expert_parallel_equals_one_process(tmp_path: Path) -> None:
    """Qwen3-MoE with ep_size=2 on two gloo ranks (each rank two of the four experts, tokens exchanged by
    torchtitan's all-to-all; FSDP2 for the rest), each rank on part of the batch: every gradient, the grad
    norm and the updated weights equal one process's step on the whole batch."""
    save_tiny_model(tmp_path / "moe", "qwen3_moe", **MOE)
    ref = make_engine(str(tmp_path / "moe"), max_token_len_per_gpu=16)
    ref_grads: dict = {}
    with ref.train_mode():
        metrics = _step_with_grads(ref, make_batch(LENGTHS), ref_grads)["metrics"]
    want = dict(ref.get_per_tensor_param()[0])
    torchrun(Path(__file__).with_name("dist_worker.py"), tmp_path, "ep", timeout=600)
    got = torch.load(tmp_path / "ep.pt")
    assert got["local_experts"] == 2 and "ep" in got["expert_mesh"]
    assert set(got["grads"]) == set(ref_grads["grads"])
    for name, value in ref_grads["grads"].items():
        torch.testing.assert_close(got["grads"][name], value, rtol=1e-5, atol=1e-6, msg=f"ep grad {name}")
    assert got["norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert set(got["params"]) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"ep {name}")
