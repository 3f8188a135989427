"""Shared helpers for the engine-fsdp tests: tiny models on disk, batches, a loss, engine construction."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core import testing
from posttrain.core.batch import LossContext, PackedBatch
from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
from posttrain.fsdp.config import FSDP1EngineConfig, FSDP2EngineConfig

VOCAB = 256


def tiny_config(tie: bool = True) -> Any:
    """The shared tiny Qwen2 (``posttrain.core.testing``) with tied embeddings and 512 positions."""
    return testing.tiny_config(max_position_embeddings=512, tie_word_embeddings=tie)


def save_tiny_model(path: str | Path, *, value_model: bool = False, tie: bool = True, seed: int = 0) -> str:
    """A random :func:`tiny_config` model (causal LM or one-label token classifier) saved as an HF
    directory."""
    return testing.save_tiny_model(
        path, seed=seed, value_model=value_model, max_position_embeddings=512, tie_word_embeddings=tie
    )


def make_batch(lengths: list[int], seed: int = 0, with_temperature: bool = True) -> PackedBatch:
    """Random sequences with a random loss mask, advantages and (optionally) per-sequence temperatures."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    masks = [(torch.rand(n, generator=gen) > 0.3).float() for n in lengths]
    fields: dict[str, list[torch.Tensor]] = {"advantages": [torch.randn(n, generator=gen) for n in lengths]}
    if with_temperature:
        fields["temperature"] = [
            torch.full((n,), 0.5 + float(torch.rand((), generator=gen))) for n in lengths
        ]
    return PackedBatch.from_sequences(seqs, masks, fields, meta={"calculate_entropy": True})


def hf_reference(path: str, batch, value_model: bool = False) -> dict[str, torch.Tensor]:
    """Per-sequence HF forwards: next-token log-probs / entropy at temperature, or values."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    out: dict[str, list[torch.Tensor]] = {"log_probs": [], "entropy": [], "values": []}
    temps = batch.split_tokens(batch.fields["temperature"])
    with torch.no_grad():
        for ids, temp in zip(batch.split_tokens(batch.input_ids), temps):
            logits = model(ids.unsqueeze(0)).logits[0].double()
            if value_model:
                out["values"].append(logits[:, 0])
                continue
            logp = torch.log_softmax(logits / temp.double().unsqueeze(-1), -1)
            lp, ent = torch.zeros(len(ids), dtype=torch.float64), torch.zeros(len(ids), dtype=torch.float64)
            lp[1:] = logp[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
            ent[1:] = -(logp.exp() * logp).sum(-1)[:-1]
            out["log_probs"].append(lp)
            out["entropy"].append(ent)
    return {k: torch.cat(v) for k, v in out.items() if v}


def pg_loss(out: dict[str, torch.Tensor], mb: PackedBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Token-mean policy-gradient loss with an entropy bonus (global token normalisation)."""
    per_token = -out["log_probs"] * mb.fields["advantages"] - 0.01 * out.get("entropy", 0.0)
    loss = (per_token * mb.loss_mask).sum() / ctx.global_num_tokens * ctx.dp_size
    return loss, {"pg_loss": float(loss.detach())}


def value_loss(out: dict[str, torch.Tensor], mb: PackedBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Token-mean squared error of the values against the advantages."""
    loss = (
        ((out["values"] - mb.fields["advantages"]) ** 2 * mb.loss_mask).sum()
        / ctx.global_num_tokens
        * ctx.dp_size
    )
    return loss, {}


def make_engine(
    path: str,
    *,
    value_model: bool = False,
    lr: float = 1e-4,
    clip_grad: float = 1.0,
    model: dict[str, Any] | None = None,
    **engine: Any,
) -> Any:
    """An initialised FSDP engine in fp32, built by its config (``strategy`` picks the variant class)."""
    engine = {"dtype": "fp32", "max_token_len_per_gpu": 4096, **engine}
    cls = FSDP1EngineConfig if engine.pop("strategy", "fsdp2") == "fsdp" else FSDP2EngineConfig
    return cls(**engine).build(
        "value_model" if value_model else "language_model",
        model=ModelConfig(path=path, **(model or {})),
        optim=OptimizerConfig(lr=lr, clip_grad=clip_grad),
        ckpt=CheckpointConfig(),
    )


def full_grads(eng: Any) -> dict[str, torch.Tensor] | None:
    """Name -> full gradient (gathered from shards) of every trainable parameter; None for FSDP1 flat
    params."""
    from torch.distributed.tensor import DTensor

    from posttrain.fsdp.modeling import _WRAPPER_PARTS

    def clean(name: str) -> str:
        for part in _WRAPPER_PARTS:
            name = name.replace(part, "")
        return name

    if type(eng.layout).__name__ == "FSDP1Layout":
        if not eng.engine_config.use_orig_params and not eng.is_lora:
            return None
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(eng.module, with_grads=True):
            return {
                clean(n): p.grad.detach().clone()
                for n, p in eng.module.named_parameters()
                if p.grad is not None
            }
    out = {}
    for name, p in eng.module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[clean(name)] = g.detach().clone().cpu()
    return out


def train_step(eng: Any, batch: PackedBatch, loss_fn: Any) -> dict[str, Any]:
    """zero_grad -> forward_backward -> grads -> optimizer_step -> params; everything gathered."""
    with eng.train_mode():
        eng.optimizer_zero_grad()
        out = eng.forward_backward_batch(batch, loss_fn)
        grads = full_grads(eng)
        norm = eng.optimizer_step()
        params = full_params(eng)
    return {
        "grads": grads,
        "params": params,
        "norm": norm,
        "loss": sum(out["loss"]),
        "output": out["model_output"],
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over matching names (a KeyError when the names differ)."""
    if sorted(a) != sorted(b):
        raise KeyError(f"names differ: {sorted(set(a) ^ set(b))[:6]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def full_params(eng: Any) -> dict[str, torch.Tensor]:
    """Name -> full parameter through the engine's own weight streams (float32; with LoRA, base + adapter)."""
    stream, _ = eng.get_per_tensor_param(dtype=torch.float32, peft_merge=False)
    out = {name: t.detach().clone().cpu() for name, t in stream}
    if eng.is_lora:
        stream, _ = eng.get_per_tensor_param(dtype=torch.float32, peft_merge=False, base_sync_done=True)
        out.update({name: t.detach().clone().cpu() for name, t in stream})
    return out


def save_tiny_adapter(model_dir: str, adapter_dir: str | Path, seed: int = 1) -> str:
    """A peft LoRA adapter (rank 4, all linear layers) with non-zero B, saved next to the tiny model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(adapter_dir))
    return str(adapter_dir)


DIST_LENGTHS = [5, 9, 3, 17, 11, 7, 20, 4, 30, 6]
"""Sequences of the data-parallel step checks; rank 0 takes the first eight (three micro-batches of <= 32
tokens), rank 1 the last two (two micro-batches, plus one filler pass)."""


def dist_cases(work: str | Path) -> dict[str, dict[str, Any]]:
    """The layouts the 2-rank test runs, each with the single-process reference it must equal."""
    work = Path(work)
    lm, value, adapter = str(work / "lm"), str(work / "value"), str(work / "adapter")
    return {
        "fsdp2": {"ref": "lm", "path": lm, "engine": {"strategy": "fsdp2"}},
        "fsdp2_hsdp": {"ref": "lm", "path": lm, "engine": {"strategy": "fsdp2", "fsdp_size": 1}},
        "fsdp2_no_reshard": {
            "ref": "lm",
            "path": lm,
            "engine": {"strategy": "fsdp2", "reshard_after_forward": False},
        },
        "fsdp2_cpu_offload_policy": {
            "ref": "lm",
            "path": lm,
            "engine": {"strategy": "fsdp2", "offload_policy": True},
        },
        "fsdp1": {"ref": "lm", "path": lm, "engine": {"strategy": "fsdp"}},
        "fsdp1_orig_params": {
            "ref": "lm",
            "path": lm,
            "engine": {"strategy": "fsdp", "use_orig_params": True},
        },
        "fsdp2_value": {"ref": "value", "path": value, "engine": {"strategy": "fsdp2"}, "value_model": True},
        "fsdp2_lora": {
            "ref": "lora",
            "path": lm,
            "engine": {"strategy": "fsdp2"},
            "model": {"lora_adapter_path": adapter},
        },
    }


def reference_cases(work: str | Path) -> dict[str, dict[str, Any]]:
    """One single-process configuration per reference name."""
    cases = dist_cases(work)
    return {"lm": cases["fsdp2"], "value": cases["fsdp2_value"], "lora": cases["fsdp2_lora"]}


def case_engine(case: dict[str, Any], strategy: bool = True) -> Any:
    engine = dict(case["engine"]) if strategy else {}
    return make_engine(
        case["path"],
        value_model=case.get("value_model", False),
        model=case.get("model"),
        max_token_len_per_gpu=32,
        **engine,
    )


def case_loss(case: dict[str, Any]) -> Any:
    return value_loss if case.get("value_model") else pg_loss


@contextlib.contextmanager
def one_rank_group(backend: str) -> Iterator[None]:
    """A 1-rank default process group in this process (what ``torchrun --nproc-per-node 1`` gives an engine),
    destroyed on exit so later tests run without one."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class AttentionCalls:
    """Counts packed-attention calls per path and the q/k/v dtypes they saw (wraps, then calls through)."""

    def __init__(self, monkeypatch: Any) -> None:
        from posttrain.fsdp import attention

        self.calls: dict[str, int] = {"varlen": 0, "per_sequence": 0}
        self.dtypes: set[tuple[torch.dtype, ...]] = set()
        for path, name in (("varlen", "_varlen"), ("per_sequence", "_per_sequence")):
            monkeypatch.setattr(attention, name, self._wrap(path, getattr(attention, name)))

    def _wrap(self, path: str, fn: Any) -> Any:
        def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> torch.Tensor:
            self.calls[path] += 1
            self.dtypes.add((q.dtype, k.dtype, v.dtype))
            return fn(q, k, v, *args)

        return counted
