"""Shared helpers for the engine-torchtitan tests: tiny HF models on disk, batches, a loss, engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.core.batch import LossContext, PackedBatch
from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
from posttrain.torchtitan.config import TorchTitanEngineConfig

VOCAB = 256


def tiny_hf_config(model_type: str = "qwen3", tie: bool = True, **overrides: Any) -> Any:
    """A 2-layer GQA config of ``model_type`` (qwen3 or llama) with head_dim 32 and 256 tokens."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32 if model_type == "qwen3" else None,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    kwargs = {k: v for k, v in kwargs.items() if v is not None} | overrides
    return AutoConfig.for_model(model_type, **kwargs)


def save_tiny_model(path: str | Path, model_type: str = "qwen3", seed: int = 0, **overrides: Any) -> str:
    """A random :func:`tiny_hf_config` causal LM saved as an HF directory (safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(model_type, **overrides), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms, so a mixed-up norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


def make_batch(lengths: list[int], seed: int = 0) -> PackedBatch:
    """Random documents with a random loss mask, advantages and per-document temperatures."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    masks = [(torch.rand(n, generator=gen) > 0.3).float() for n in lengths]
    fields = {
        "advantages": [torch.randn(n, generator=gen) for n in lengths],
        "temperature": [torch.full((n,), 0.5 + float(torch.rand((), generator=gen))) for n in lengths],
    }
    return PackedBatch.from_sequences(seqs, masks, fields, meta={"calculate_entropy": True})


def pg_loss(out: dict[str, torch.Tensor], mb: PackedBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Token-mean policy-gradient loss with an entropy bonus (global token normalisation)."""
    per_token = -out["log_probs"] * mb.fields["advantages"] - 0.01 * out.get("entropy", 0.0)
    loss = (per_token * mb.loss_mask).sum() / ctx.global_num_tokens * ctx.dp_size
    return loss, {"pg_loss": float(loss.detach())}


def make_engine(path: str, *, lr: float = 1e-3, model: dict | None = None, **engine: Any) -> Any:
    """An initialised torchtitan engine in fp32."""
    from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine

    engine = {"dtype": "fp32", "max_token_len_per_gpu": 4096, **engine}
    eng = TorchTitanLanguageModelEngine(
        ModelConfig(path=path, **(model or {})),
        TorchTitanEngineConfig(**engine),
        OptimizerConfig(lr=lr, clip_grad=1.0),
        CheckpointConfig(),
    )
    eng.initialize()
    return eng


def load_hf(path: str) -> Any:
    """The HF causal LM of ``path`` in fp32, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def packed_and_hf_logits(eng: Any, hf: Any, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the engine module's logits of ``batch`` as one packed row, HF's one document at a time), on the
    CPU."""
    from posttrain.torchtitan.attention import packed_metadata

    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        on_device = batch.to(eng.device)
        meta = packed_metadata(cu, eng.device)
        logits = eng.module(on_device.input_ids[None], on_device.position_ids[None], meta)[0].cpu()
        ref = torch.cat([hf(batch.input_ids[a:b][None]).logits[0] for a, b in zip(cu[:-1], cu[1:])])
    return logits, ref
