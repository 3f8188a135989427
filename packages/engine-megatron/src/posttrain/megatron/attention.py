"""Variable-length (THD) core attention for Megatron-Core's local layer spec, and the layer spec choice.

Megatron-Core's local ``DotProductAttention`` refuses packed sequences and context parallelism: only
Transformer Engine's attention reads ``PackedSeqParams``. :class:`VarlenDotProductAttention` keeps the local
module's parameters and scaling and adds the packed path: query/key/value arrive as ``(T, heads, head_dim)``
for the whole packed stream and each sequence ``cu_seqlens[i]:cu_seqlens[i+1]`` attends causally to itself
only (one ``torch.nn.attention.varlen.varlen_attn`` flash call on CUDA in bf16/fp16, SDPA per sequence
elsewhere; see
:func:`.context_parallel.varlen_causal_attention`). Under context parallelism (``context_parallel_size > 1``)
the stream holds this rank's two chunks of every sequence; keys and values are all-gathered over the CP group
and each query chunk attends to the key prefix of its sequence up to its own end (:mod:`.context_parallel`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention

from .context_parallel import gather_keys_values, varlen_causal_attention

CP_COMM_TYPES = (None, "all_gather", "allgather")
"""``cp_comm_type`` values the local attention implements (None: its default, all-gather)."""


class VarlenDotProductAttention(DotProductAttention):
    """Local core attention that also accepts packed THD input (``packed_seq_params.qkv_format == 'thd'``) and
    context parallelism on it (all-gather of keys and values over the CP group)."""

    def __init__(
        self, config: Any, *args: Any, cp_comm_type: Any = None, pg_collection: Any = None, **kw: Any
    ):
        cp = config.context_parallel_size
        if cp > 1 and cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={cp_comm_type!r}: the local attention implements context parallelism by "
                "all-gathering keys and values only; drop cp_comm_type from "
                "engine.override_transformer_config or set it to 'all_gather'"
            )
        local = copy.copy(config)  # the parent refuses CP > 1 (only TE's attention had it)
        local.context_parallel_size = 1
        super().__init__(local, *args, cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kw)
        self.config = config
        self.cp_group = None
        if cp > 1:
            from megatron.core import parallel_state as mpu

            self.cp_group = getattr(pg_collection, "cp", None) or mpu.get_context_parallel_group()

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
        if packed_seq_params is None and self.cp_group is None:
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
            )
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            fmt = None if packed_seq_params is None else packed_seq_params.qkv_format
            raise ValueError(
                f"packed_seq_params.qkv_format={fmt!r}: the local varlen attention handles only thd "
                "(and context parallelism only on packed thd streams)"
            )
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        cu_q = cu_k = packed_seq_params.cu_seqlens_q
        max_q = max_k = int(packed_seq_params.max_seqlen_q)
        if self.cp_group is not None:
            plan = getattr(packed_seq_params, "cp_plan", None)
            if plan is None:
                raise ValueError(
                    "context_parallel_size > 1 needs packed_seq_params built by "
                    "posttrain.megatron.context_parallel.split_micro_batch (a CpPackedSeqParams with cp_plan)"
                )
            key, value = gather_keys_values(key, value, plan, self.cp_group)
            cu_q, cu_k = plan.cu_seqlens_q, plan.cu_seqlens_k
            max_q, max_k = plan.max_seqlen_q, plan.max_seqlen_k
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = varlen_causal_attention(query, key, value, cu_q, cu_k, max_q, max_k, scale, dropout)
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
    """The decoder spec: Transformer Engine's layers when installed, else the local layers with varlen
    attention and :class:`TorchNorm` (a block spec, so the final norm is a :class:`TorchNorm` too)."""
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
