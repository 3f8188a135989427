"""Variable-length (THD) core attention for Megatron-Core's local layer spec, and the layer spec choice.

Megatron-Core's local ``DotProductAttention`` refuses packed sequences: only Transformer Engine's attention
reads ``PackedSeqParams``. :class:`VarlenDotProductAttention` keeps the local module's parameters and scaling
and adds the packed path: query/key/value arrive as ``(T, heads, head_dim)`` for the whole packed stream and
each sequence ``cu_seqlens[i]:cu_seqlens[i+1]`` attends causally to itself only. On CUDA with bf16/fp16 it
calls ``torch.nn.attention.varlen.varlen_attn`` (one flash kernel over all sequences, causal through
``window_size=(-1, 0)``); otherwise it runs ``scaled_dot_product_attention(is_causal=True)`` per sequence.
Transformer Engine's fused attention does the same in one kernel and also covers context parallelism.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.transformer.dot_product_attention import DotProductAttention


def _has_varlen() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


class VarlenDotProductAttention(DotProductAttention):
    """Local core attention that also accepts packed THD input (``packed_seq_params.qkv_format == 'thd'``)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: the local varlen "
                "attention handles only thd"
            )
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        cu = packed_seq_params.cu_seqlens_q
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        if (
            query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16)
            and dropout == 0.0
            and _has_varlen()
        ):
            from torch.nn.attention.varlen import varlen_attn

            max_len = int(packed_seq_params.max_seqlen_q)
            out = varlen_attn(query, key, value, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))
        else:
            out = torch.empty_like(query)
            bounds = cu.tolist()
            for start, end in zip(bounds[:-1], bounds[1:]):
                q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
                out[start:end] = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, dropout_p=dropout, scale=scale
                ).transpose(0, 1)
        return out.reshape(out.size(0), -1)


class TorchNorm:
    """torch ``RMSNorm`` / ``LayerNorm`` usable under sequence parallelism.

    Megatron-Core's ``WrappedTorchNorm`` refuses sequence parallelism only because nothing marks the norm
    weights: with SP each TP rank normalises its own sequence shard, so the weight gradients are partial sums
    that ``finalize_model_grads`` all-reduces over TP for parameters flagged ``sequence_parallel``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} has no local implementation: use RMSNorm "
                "or LayerNorm models, or install Transformer Engine"
            )
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _swap_norms(spec: Any) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    subs = getattr(spec, "submodules", None)
    if subs is None or not hasattr(subs, "__dataclass_fields__"):
        return
    for name in subs.__dataclass_fields__:
        value = getattr(subs, name)
        if value is WrappedTorchNorm:
            setattr(subs, name, TorchNorm)
        elif hasattr(value, "submodules"):
            _swap_norms(value)


def layer_spec(provider: Any, use_te: bool, vp_stage: int | None = None) -> Any:
    """The decoder spec: Transformer Engine's layers when installed, else the local layers with varlen attention
    and :class:`TorchNorm` (a block spec, so the final norm is a :class:`TorchNorm` too)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    kwargs = dict(
        num_experts=provider.num_moe_experts,
        moe_grouped_gemm=provider.moe_grouped_gemm,
        qk_layernorm=provider.qk_layernorm,
    )
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**kwargs)
    spec = get_gpt_layer_local_spec(normalization=provider.normalization, **kwargs)
    spec.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
    _swap_norms(spec)
    layers = get_num_layers_to_build(provider, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=TorchNorm)
