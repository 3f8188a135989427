"""Device tests on ONE GPU with the real Transformer Engine (no stand-in): the engine's TE layer-spec branch.

With TE importable, ``megatron_cpu.install_te_standin`` registers nothing and Megatron-Core's ``HAVE_TE`` is
true, so ``posttrain.megatron.attention.layer_spec`` returns Megatron-Core's TE spec (fused norm + linear, TE
attention on packed THD streams, TE grouped GEMM for MoE experts) and ``build.make_provider`` keeps the
provider's fused kernels on. Each test launches ``te_worker.py`` under torchrun with one process (NCCL, one
GPU) and asserts on the numbers it writes.

Bounds are derived from the run itself, not fixed: TE computes float32 GEMMs in TF32 (cuBLAS
``COMPUTE_32F_FAST_TF32``), so the float32 bound is :data:`FACTOR` times how far HF's own forward moves with
TF32 matmuls (floored at :data:`FP32_FLOOR`, the 2-GPU float32 parity bound of ``test_gpu.py``); the bfloat16
bounds are :data:`FACTOR` times how far HF's own bfloat16 forward is from its float32 one (max and mean over
tokens). An HF model of another seed must be farther from the reference than every bound, so the bounds can
catch a wrong weight mapping.

Install TE first (docs/megatron-engine.md, "Prebuilt here instead"), then on the GPU machine:
``bash scripts/te_build_gpu.sh install .te-parts/prebuilt; eval "$(bash scripts/install_megatron_wheels.sh)";
export PYTHONPATH=/tmp/site; python3 -m pytest -q -m gpu packages/engine-megatron/tests/test_gpu_te.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.core.testing import torchrun

HERE = Path(__file__).parent
FACTOR = 4.0
"""How many times HF's own precision noise (TF32, bfloat16) the engine may deviate from HF float32."""
FP32_FLOOR = 2e-5
"""Lower end of the float32 bound: the engine's float32 log-prob parity without TE (``test_gpu.py``)."""
INSTALL = "bash scripts/te_build_gpu.sh install .te-parts/prebuilt"


def _te_import_error() -> str | None:
    """Why ``import transformer_engine.pytorch`` fails here (None when it imports or there is no GPU to try
    on).

    The import runs in a child process so this pytest process never loads TE (other test files register a
    TE stand-in in-process)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    if not torch.cuda.is_available():
        return None
    # torch first, as every user of TE does: TE's core library needs libnccl.so.2, which a pip-installed torch
    # brings into the process (``import transformer_engine`` alone fails on a venv with torch 2.11.0 from
    # PyPI)
    probe = [sys.executable, "-c", "import torch, transformer_engine.pytorch"]
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "the import took over 120 s"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


TE_ERROR = _te_import_error()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        TE_ERROR is not None,
        reason=f"import transformer_engine.pytorch failed ({TE_ERROR}): install TE with `{INSTALL}`",
    ),
]


def _run(mode: str, out_dir: Path) -> dict:
    torchrun(HERE / "te_worker.py", mode, out_dir, nproc=1, timeout=300)
    return json.loads((out_dir / f"{mode}_results.json").read_text())


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict:
    """One worker run for the dense tests: a tiny Qwen2 (head_dim 64) at TP=1, float32 and bfloat16."""
    return _run("dense", tmp_path_factory.mktemp("te_dense"))


def _assert_te_layers(report: dict) -> None:
    """Every checked decoder part is the expected TE class, nothing of the local spec is left, and the fused
    RoPE, SwiGLU and bias-dropout-add (``build.CUDA_TE_FUSIONS``) are on: the parity bounds hold with them."""
    assert report["has_transformer_engine"], "Megatron-Core found no Transformer Engine (HAVE_TE is false)"
    assert report["te_file"], f"transformer_engine is a stand-in, not the real package: {report}"
    wrong = {k: report["classes"][k] for k, ok in report["is_te"].items() if not ok}
    assert not wrong, f"not Transformer Engine modules: {wrong}"
    assert report["local_in_decoder"] == [], report["local_in_decoder"]
    assert all(report["fusions"].values()), f"fusions off on CUDA with TE: {report['fusions']}"


def _assert_parity(res: dict) -> None:
    """float32 log-probs within the TF32-derived bound, bfloat16 within the bfloat16-derived bounds (max and
    mean), and an HF model of another seed farther away than any of them."""
    fp32_bound = max(FACTOR * res["hf_tf32_maxdiff"], FP32_FLOOR)
    bf16_max_bound = FACTOR * res["hf_bf16_maxdiff"]
    bf16_mean_bound = FACTOR * res["hf_bf16_meandiff"]
    assert res["hf_bf16_maxdiff"] > 0, "HF's bfloat16 forward equals its float32 one: no bound to derive"
    assert res["fp32_maxdiff"] <= fp32_bound, (res["fp32_maxdiff"], fp32_bound)
    assert res["bf16_maxdiff"] <= bf16_max_bound, (res["bf16_maxdiff"], bf16_max_bound)
    assert res["bf16_meandiff"] <= bf16_mean_bound, (res["bf16_meandiff"], bf16_mean_bound)
    assert res["other_model_maxdiff"] > max(fp32_bound, bf16_max_bound), res


def test_te_layer_spec_is_built(dense):
    """The engine built from a tiny HF Qwen2 at TP=1 on one GPU, in float32 and in bfloat16, has Transformer
    Engine layers: per decoder layer ``linear_qkv`` and ``mlp.linear_fc1`` are ``te.pytorch.LayerNormLinear``,
    ``linear_proj`` and ``mlp.linear_fc2`` ``te.pytorch.Linear``, ``core_attention``
    ``te.pytorch.DotProductAttention``; the final norm is a TE class; the decoder holds none of
    Megatron-Core's local linears / attention or torch norms; ``_deps.has_transformer_engine()`` is true and
    the imported ``transformer_engine`` is a real package (it has a file; the stand-in has none)."""
    for dtype in ("fp32", "bf16"):
        _assert_te_layers(dense[f"{dtype}_layers"])


def test_te_logprobs_equal_hf(dense):
    """The engine's log-prob pass (``infer_batch``, 8 packed sequences, 360 tokens, 4 micro-batches) equals an
    HF forward of the same weights on the GPU (float32, TF32 off): in float32 within FACTOR x HF's TF32
    deviation (at least FP32_FLOOR), in bfloat16 within FACTOR x HF-bfloat16's deviation in max and in mean; a
    model of another seed deviates by more than those bounds."""
    _assert_parity(dense)


def test_te_wgrad_fusion_equals_megatron_hooks(tmp_path):
    """Without APEX the engine turns on TE's own weight-gradient fusion for every dense TE layer under
    Megatron DDP (``build.fuse_te_wgrad``: the wgrad GEMM accumulates into the fp32 ``main_grad``, four per
    decoder layer), and ``override_transformer_config`` setting ``gradient_accumulation_fusion`` false leaves
    all off. Three float32 steps (four micro-batches each) give the same grad norms and log-probs both ways: a
    gradient added twice or lost would double or drop the norm."""
    res = _run("wgrad", tmp_path)
    assert res["fused_modules"] == 4 * res["layers"] and res["unfused_modules"] == 0, res
    for fused, unfused in zip(res["fused_grad_norms"], res["unfused_grad_norms"], strict=True):
        assert abs(fused - unfused) <= 1e-4 * unfused, res
    diff = max(abs(a - b) for a, b in zip(res["fused_log_probs"], res["unfused_log_probs"], strict=True))
    assert diff <= FP32_FLOOR, diff


def test_megatron_fsdp_te_logprobs_equal_hf(tmp_path):
    """The same through Megatron-FSDP (``use_megatron_fsdp=True``, the distributed optimizer, DP=1 on one
    GPU):
    the layers are TE's in float32 and bfloat16, and the log-probs meet the bounds of
    :func:`test_te_logprobs_equal_hf`."""
    res = _run("fsdp", tmp_path)
    for dtype in ("fp32", "bf16"):
        _assert_te_layers(res[f"{dtype}_layers"])
    _assert_parity(res)


def test_moe_grouped_gemm_router_replay(tmp_path):
    """A tiny Qwen3-MoE (``posttrain.core.testing.TINY_QWEN3_MOE``, head_dim 64; the model of
    ``tests/make_tiny_moe.py`` without its tokenizer) with ``moe_grouped_gemm=True`` at EP=1 on one GPU,
    float32.

    Built: every layer's experts are Megatron-Core's ``TEGroupedMLP`` over TE ``GroupedLinear``s, attention
    and norms are TE's. R2 (moe_worker.py's checks): recording the routing twice gives the same experts; a
    training pass replaying the record gives the recorded log-probs exactly; replaying experts shifted by one
    changes them by more than 1e-3; three training steps on the replayed routing lower the loss. The recorded
    pass matches HF float32: the median token deviation is within FACTOR x HF's own TF32 median deviation (the
    median, since a near-tie can flip a token's experts under TF32 noise). R3: the routers' own routing, read
    by forward hooks and given as ``routed_experts``, reproduces the free pass's log-probs exactly in a
    forward-only and in a training pass, the routers use exactly those experts, and a shifted routing is what
    the routers then use and changes the log-probs by more than 1e-3."""
    res = _run("moe", tmp_path)
    _assert_te_layers(res["layers"])
    assert res["moe_grouped_gemm"]
    assert all(c.endswith(".TEGroupedMLP") for c in res["experts_classes"]), res["experts_classes"]
    assert all(res["experts_grouped_linear"]), res["experts_grouped_linear"]
    assert res["record_deterministic"]
    assert res["replay_logprob_maxdiff"] == 0.0
    assert res["other_routing_logprob_maxdiff"] > 1e-3
    assert res["losses"][2] < res["losses"][0], res["losses"]
    median_bound = max(FACTOR * res["hf_tf32_mediandiff"], FP32_FLOOR)
    assert res["recorded_mediandiff"] <= median_bound, (res["recorded_mediandiff"], median_bound)
    assert res["r3_replay_logprob_maxdiff"] == 0.0
    assert res["r3_train_replay_logprob_maxdiff"] == 0.0
    assert res["r3_replayed_maps_equal"]
    assert res["r3_other_maps_follow"]
    assert res["r3_other_routing_logprob_maxdiff"] > 1e-3


def test_megatron_fsdp_bf16_checkpoint_round_trip(tmp_path):
    """A bfloat16 Megatron-FSDP engine (TE layers, the distributed optimizer, DP=1 on one GPU) saves an
    fsdp_dtensor checkpoint after one step and a fresh engine loads it: the same parameters and Adam moments
    (exactly), the same LR step, and a second step of the same loss. In bfloat16 the model sits in a
    Float16Module inside Megatron-FSDP; the float32 test of ``test_gpu.py`` never had one, and the save failed
    on it."""
    from megatron_cpu import make_tiny_qwen2

    hf = make_tiny_qwen2(str(tmp_path / "hf"))
    torchrun(
        HERE / "fsdp_ckpt_worker.py",
        "save",
        hf,
        tmp_path,
        nproc=1,
        timeout=300,
        env={"FSDP_CKPT_DTYPE": "bfloat16"},
    )
    res = json.loads((tmp_path / "save_results.json").read_text())
    assert res["moment_norm"] > 0 and res["lr_step"] == 1
    assert res["param_maxdiff"] == 0.0 and res["moment_maxdiff"] == 0.0
    # the second step's loss only: TE's attention backward need not repeat bits, and one flipped rounding of a
    # bfloat16 norm weight near 1.0 is 0.0078, more than the step itself
    assert res["loss2_diff"] < 1e-3, res
