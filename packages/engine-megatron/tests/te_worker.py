"""torchrun worker (ONE GPU, the real Transformer Engine) for ``test_gpu_te.py``.

Usage: ``torchrun --nproc-per-node 1 te_worker.py {dense,fsdp,moe} OUT_DIR``; writes
``OUT_DIR/<mode>_results.json`` with raw measurements only (the test holds the bounds):

- ``dense``: a tiny Qwen2 whose sizes TE's kernels take (head_dim 64, hidden 256) through the engine at TP=1
  in float32 and in bfloat16 (Megatron DDP): which classes the decoder's layers are, and the per-token
  log-probs' deviation from an HF forward of the same weights on the GPU (float32, TF32 matmuls off). The HF
  forward is also run with TF32 matmuls and in bfloat16 (the noise scales the bounds are derived from), and
  for an HF model of another seed (what a wrong weight mapping would look like).
- ``fsdp``: the same model through Megatron-FSDP (``use_megatron_fsdp``, DP=1), float32 and bfloat16.
- ``wgrad``: the dense model's float32 engine (Megatron DDP, four micro-batches a step) with TE's weight
  gradients accumulated into the fp32 buffer by the GEMM (``build.fuse_te_wgrad``, the default without APEX)
  and with ``gradient_accumulation_fusion`` set false: fused module count, three steps' grad norms and the
  log-probs after them, each way (TF32 matmuls off).
- ``moe``: a tiny Qwen3-MoE (:data:`posttrain.core.testing.TINY_QWEN3_MOE`, head_dim 64) with
  ``moe_grouped_gemm=True`` at EP=1: expert classes; R2 records routing in a forward-only pass and a training
  pass replays it, another routing is replayed, three steps train; R3 replays a routing read from the routers
  (forward hooks) in a forward-only and a training pass, and a shifted routing drives the routers.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
from pathlib import Path

import torch

TE_QWEN2 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""Overrides of the tiny Qwen2: head_dim 256/4 = 64 and hidden sizes that are multiples of 64."""

TE_QWEN3_MOE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, head_dim=64)
"""Overrides of the tiny Qwen3-MoE (4 experts, top-2, both layers MoE): head_dim 64, multiples of 64."""

LENGTHS = [37, 64, 5, 100, 23, 71, 12, 48]
"""Eight packed sequences, 360 tokens (vocabulary 256)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["dense", "fsdp", "wgrad", "moe"])
    parser.add_argument("out_dir", type=Path)
    return parser.parse_args(argv)


def te_batch():
    """:data:`LENGTHS` random sequences; the first two tokens of each are prompt (loss mask 0)."""
    from posttrain.core.batch import PackedBatch

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]
    masks = [torch.cat([torch.zeros(2), torch.ones(n - 2)]) for n in LENGTHS]
    return PackedBatch.from_sequences(seqs, masks)


def scored(batch) -> torch.Tensor:
    """(T,) bool: every token but each sequence's first (whose log-prob is 0 by definition)."""
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep[batch.cu_seqlens[:-1].long()] = False
    return keep


def stats(name: str, a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Max, mean and median of ``|a - b|`` over the scored tokens, as ``<name>_{max,mean,median}diff``."""
    d = (a.double() - b.double()).abs()[keep]
    return {
        f"{name}_maxdiff": float(d.max()),
        f"{name}_meandiff": float(d.mean()),
        f"{name}_mediandiff": float(d.median()),
    }


@contextlib.contextmanager
def matmul_tf32(enabled: bool):
    """torch's float32 matmuls in TF32 (``enabled``) or in full float32 inside the block."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def load_hf(path: str):
    """The HF model on the GPU in float32 with eager attention (and eager experts where transformers has
    them)."""
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.float32, attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw)
    except (TypeError, ValueError):  # a transformers without experts_implementation
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    return model.cuda().eval()


def gpu_log_probs(model, batch) -> torch.Tensor:
    """Per-token log-probs of ``batch`` from an HF model on the GPU, one sequence at a time (float64
    softmax)."""
    out = []
    with torch.no_grad():
        for seq in batch.split_tokens(batch.input_ids):
            ids = seq.cuda()
            logits = model(ids[None]).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
            out.append(torch.cat([lp.new_zeros(1), lp]).cpu())
    return torch.cat(out)


def hf_references(path: str, batch, with_bf16: bool = True) -> dict[str, torch.Tensor]:
    """HF log-probs: ``fp32`` (TF32 off, the reference), ``tf32`` (TF32 matmuls) and ``bf16`` (bfloat16
    weights)."""
    model = load_hf(path)
    refs = {}
    with matmul_tf32(False):
        refs["fp32"] = gpu_log_probs(model, batch)
    with matmul_tf32(True):
        refs["tf32"] = gpu_log_probs(model, batch)
    if with_bf16:
        with matmul_tf32(False):
            refs["bf16"] = gpu_log_probs(model.to(torch.bfloat16), batch)
    del model
    torch.cuda.empty_cache()
    return refs


def reference_noise(refs: dict[str, torch.Tensor], keep: torch.Tensor) -> dict[str, float]:
    """How far HF's own TF32 and bfloat16 forwards are from its float32 forward (the bounds' scales)."""
    res = stats("hf_tf32", refs["tf32"], refs["fp32"], keep)
    if "bf16" in refs:
        res.update(stats("hf_bf16", refs["bf16"], refs["fp32"], keep))
    return res


def engine_log_probs(eng, batch) -> torch.Tensor:
    """The engine's log-prob pass (``infer_batch`` in eval mode), torch's own matmuls in full float32."""
    with matmul_tf32(False), eng.eval_mode():
        return eng.infer_batch(batch)["model_output"]["log_probs"].double().cpu()


def qualname(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def local_modules(model: torch.nn.Module) -> list[str]:
    """Classes in ``model`` from Megatron-Core's local spec or posttrain's local layers (none with the TE
    spec)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    local = (ColumnParallelLinear, RowParallelLinear, DotProductAttention)
    torch_norms = (torch.nn.RMSNorm, torch.nn.LayerNorm)
    return sorted({qualname(m) for m in model.modules() if isinstance(m, local) or type(m) in torch_norms})


def from_te(module: torch.nn.Module) -> bool:
    """True when ``module``'s class is Transformer Engine's or derives from one (Megatron's TE wrappers)."""
    return any(c.__module__.startswith("transformer_engine.") for c in type(module).__mro__)


def layer_report(eng, parts: dict[str, object]) -> dict[str, object]:
    """Per decoder layer: the class of each part in ``parts`` (name -> expected TE class, or None for any
    Transformer Engine class) and whether it is that; the final norm's; local classes left in the decoder;
    whether Megatron-Core found TE; which ``transformer_engine`` was imported; the model's CUDA fusions."""
    import transformer_engine

    from posttrain.megatron import _deps, build

    model = build.unwrap(eng.chunks[0])
    classes, is_te = {}, {}
    for i, layer in enumerate(model.decoder.layers):
        for name, cls in parts.items():
            module = layer.get_submodule(name)
            classes[f"layers.{i}.{name}"] = qualname(module)
            is_te[f"layers.{i}.{name}"] = from_te(module) if cls is None else isinstance(module, cls)
    norm = model.decoder.final_layernorm
    classes["final_layernorm"] = qualname(norm)
    is_te["final_layernorm"] = from_te(norm)
    return {
        "classes": classes,
        "is_te": is_te,
        "local_in_decoder": local_modules(model.decoder),
        "has_transformer_engine": _deps.has_transformer_engine(),
        "te_file": getattr(transformer_engine, "__file__", None),  # the stand-in has none
        "te_version": getattr(transformer_engine, "__version__", None),
        "fusions": {name: getattr(model.config, name) for name in build.CUDA_TE_FUSIONS},
    }


def attention_parts() -> dict[str, object]:
    """The attention's TE classes: fused norm + QKV linear, TE's attention, TE's output linear."""
    import transformer_engine.pytorch as te

    return {
        "self_attention.linear_qkv": te.LayerNormLinear,
        "self_attention.core_attention": te.DotProductAttention,
        "self_attention.linear_proj": te.Linear,
    }


def dense_parts() -> dict[str, object]:
    """A dense layer's TE classes: the attention's and the MLP's fused norm + fc1 and fc2."""
    import transformer_engine.pytorch as te

    return {**attention_parts(), "mlp.linear_fc1": te.LayerNormLinear, "mlp.linear_fc2": te.Linear}


def moe_parts() -> dict[str, object]:
    """An MoE layer's TE classes: the attention's, its q/k norms and the pre-MLP norm (any TE norm)."""
    names = ("self_attention.q_layernorm", "self_attention.k_layernorm", "pre_mlp_layernorm")
    return {**attention_parts(), **dict.fromkeys(names)}


def run_engines(hf: str, batch, keep, refs, **engine_kw) -> dict[str, object]:
    """The engine in float32 and bfloat16 (``engine_kw`` added): layer classes and deviation from HF fp32."""
    from megatron_cpu import make_engine

    res: dict[str, object] = {}
    for dtype, tag in (("float32", "fp32"), ("bfloat16", "bf16")):
        eng = make_engine(hf, dtype=dtype, **engine_kw)
        res[f"{tag}_layers"] = layer_report(eng, dense_parts())
        res.update(stats(tag, engine_log_probs(eng, batch), refs["fp32"], keep))
        del eng
        torch.cuda.empty_cache()
    return res


def run_dense(out_dir: Path, **engine_kw) -> dict[str, object]:
    """TP=1 (Megatron DDP, or what ``engine_kw`` selects): TE layer classes, log-probs against HF, HF
    noise."""
    from megatron_cpu import make_tiny_qwen2

    hf = make_tiny_qwen2(str(out_dir / "hf"), **TE_QWEN2)
    other = make_tiny_qwen2(str(out_dir / "hf_other"), seed=1, **TE_QWEN2)
    batch = te_batch()
    keep = scored(batch)
    refs = hf_references(hf, batch)
    res: dict[str, object] = reference_noise(refs, keep)
    with matmul_tf32(False):
        res.update(stats("other_model", gpu_log_probs(load_hf(other), batch), refs["fp32"], keep))
    res.update(run_engines(hf, batch, keep, refs, **engine_kw))
    return res


def run_fsdp(out_dir: Path) -> dict[str, object]:
    """:func:`run_dense` through Megatron-FSDP (ZeRO-3 at DP=1, the distributed optimizer)."""
    return run_dense(out_dir, use_megatron_fsdp=True, use_distributed_optimizer=True)


def run_wgrad(out_dir: Path) -> dict[str, object]:
    """The ``wgrad`` mode (module docstring)."""
    from megatron_cpu import make_engine, make_tiny_qwen2, nll_loss

    from posttrain.megatron import build

    hf = make_tiny_qwen2(str(out_dir / "hf"), **TE_QWEN2)
    batch = te_batch()
    res: dict[str, object] = {}
    for tag, override in (("fused", {}), ("unfused", {"gradient_accumulation_fusion": False})):
        eng = make_engine(hf, override_transformer_config=override)
        res["layers"] = build.unwrap(eng.chunks[0]).config.num_layers
        res[f"{tag}_modules"] = sum(
            bool(getattr(m, "fuse_wgrad_accumulation", False)) for c in eng.chunks for m in c.modules()
        )
        with matmul_tf32(False), eng.train_mode():
            norms = [eng.train_batch(batch, nll_loss)["metrics"]["grad_norm"] for _ in range(3)]
        res[f"{tag}_grad_norms"] = [float(n) for n in norms]
        res[f"{tag}_log_probs"] = engine_log_probs(eng, batch)[scored(batch)].tolist()
        del eng
        torch.cuda.empty_cache()
    return res


def experts_report(eng) -> dict[str, object]:
    """Each MoE layer's experts class and whether its fc1 / fc2 are TE ``GroupedLinear``s; the provider
    flag."""
    import transformer_engine.pytorch as te

    from posttrain.megatron import build

    layers = build.unwrap(eng.chunks[0]).decoder.layers
    experts = [layer.mlp.experts for layer in layers]
    return {
        "experts_classes": [qualname(e) for e in experts],
        "experts_grouped_linear": [
            isinstance(getattr(e, "linear_fc1", None), te.GroupedLinear)
            and isinstance(getattr(e, "linear_fc2", None), te.GroupedLinear)
            for e in experts
        ],
        "moe_grouped_gemm": bool(eng.provider.moe_grouped_gemm),
    }


def capture_pass(eng, batch, routing) -> torch.Tensor:
    """Log-probs of one training-mode forward/backward with ``fields['routed_experts'] = routing`` (no
    step)."""
    from megatron_cpu import nll_loss

    captured: list[torch.Tensor] = []

    def capture(out, micro, ctx):
        captured.append(out["log_probs"].detach().double().cpu())
        return nll_loss(out, micro, ctx)

    batch.fields["routed_experts"] = routing
    with matmul_tf32(False), eng.train_mode():
        eng.forward_backward_batch(batch, capture)
        eng.optimizer_zero_grad()
    return torch.cat(captured)


def r2_checks(eng, batch, num_experts: int) -> dict[str, object]:
    """moe_worker.py's R2 checks on one GPU: record twice, replay in a training pass, replay another routing,
    train three steps on the recorded routing."""
    from megatron_cpu import nll_loss

    with matmul_tf32(False), eng.eval_mode():
        first = eng.infer_batch(batch)["model_output"]
        again = eng.infer_batch(batch)["model_output"]
    routed = first["routed_experts"]
    recorded = first["log_probs"].double().cpu()
    replayed = capture_pass(eng, batch, routed)
    shifted = capture_pass(eng, batch, (routed + 1) % num_experts)
    batch.fields["routed_experts"] = routed
    with matmul_tf32(False), eng.train_mode():
        losses = [sum(eng.train_batch(batch, nll_loss)["loss"]) for _ in range(3)]
    del batch.fields["routed_experts"]
    return {
        "recorded_shape": list(routed.shape),
        "record_deterministic": bool(torch.equal(routed, again["routed_experts"])),
        "replay_logprob_maxdiff": float((replayed - recorded).abs().max()),
        "other_routing_logprob_maxdiff": float((shifted - recorded).abs().max()),
        "losses": losses,
        "recorded_log_probs": recorded,
    }


def observed_routing(eng, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, (T, layers, experts) bool maps the routers used) of a forward-only pass, read by forward
    hooks on Megatron-Core's ``TopKRouter``s (one micro-batch, no padding at TP=1)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in eng.chunks[0].modules() if isinstance(m, TopKRouter)]
    maps: dict[int, list[torch.Tensor]] = {id(r): [] for r in routers}
    handles = [r.register_forward_hook(lambda m, a, out: maps[id(m)].append(out[1].cpu())) for r in routers]
    try:
        lp = engine_log_probs(eng, batch)
    finally:
        for h in handles:
            h.remove()
    used = torch.stack([torch.cat(maps[id(r)])[: batch.num_tokens] for r in routers], dim=1)
    return lp, used


def r3_checks(eng, batch, num_experts: int, top_k: int) -> dict[str, object]:
    """R3: the routers' own routing (read by hooks) given as ``routed_experts`` in a forward-only and a
    training pass; a shifted routing given the same way."""
    free_lp, free_maps = observed_routing(eng, batch)
    indices = free_maps.float().topk(top_k, dim=-1).indices.to(torch.int32)  # (T, layers, k)
    batch.fields["routed_experts"] = indices
    lp, maps = observed_routing(eng, batch)
    train_lp = capture_pass(eng, batch, indices)
    shifted = (indices + 1) % num_experts
    batch.fields["routed_experts"] = shifted
    other_lp, other_maps = observed_routing(eng, batch)
    del batch.fields["routed_experts"]
    shifted_maps = torch.zeros_like(free_maps).scatter_(2, shifted.long(), True)
    return {
        "r3_replay_logprob_maxdiff": float((lp - free_lp).abs().max()),
        "r3_train_replay_logprob_maxdiff": float((train_lp - free_lp).abs().max()),
        "r3_replayed_maps_equal": bool(torch.equal(maps, free_maps)),
        "r3_other_maps_follow": bool(torch.equal(other_maps, shifted_maps)),
        "r3_other_routing_logprob_maxdiff": float((other_lp - free_lp).abs().max()),
    }


def run_moe(out_dir: Path) -> dict[str, object]:
    """Grouped-GEMM experts at EP=1 in float32: R2 and R3 replay, and the recorded pass against HF."""
    from megatron_cpu import make_engine

    from posttrain.core.config import RouterReplayConfig
    from posttrain.core.testing import TINY_QWEN3_MOE, save_tiny_model

    path = save_tiny_model(out_dir / "moe", "qwen3_moe", **TE_QWEN3_MOE)
    batch = te_batch()
    keep = scored(batch)
    refs = hf_references(path, batch, with_bf16=False)
    num_experts, top_k = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["num_experts_per_tok"]
    kw = dict(micro_batch_size_per_gpu=batch.num_seqs, override_transformer_config={"moe_grouped_gemm": True})
    res: dict[str, object] = reference_noise(refs, keep)
    eng = make_engine(path, router_replay=RouterReplayConfig(mode="R2"), **kw)
    res["layers"] = layer_report(eng, moe_parts())
    res.update(experts_report(eng))
    r2 = r2_checks(eng, batch, num_experts)
    res.update(stats("recorded", r2.pop("recorded_log_probs"), refs["fp32"], keep))
    res.update(r2)
    del eng
    torch.cuda.empty_cache()
    eng = make_engine(path, router_replay=RouterReplayConfig(mode="R3"), **kw)
    res.update(r3_checks(eng, batch, num_experts, top_k))
    return res


def main() -> None:
    args = parse_args()
    faulthandler.dump_traceback_later(int(os.environ.get("WORKER_TIMEOUT_S", "280")), exit=True)
    from megatron_cpu import prepare_environment

    prepare_environment()  # with a real TE imported this registers no stand-in
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run = {"dense": run_dense, "fsdp": run_fsdp, "wgrad": run_wgrad, "moe": run_moe}[args.mode]
    res = run(args.out_dir)
    (args.out_dir / f"{args.mode}_results.json").write_text(json.dumps(res, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
