"""Packed (per-document causal) attention for torchtitan models, and the document boundaries it reads.

The engine runs a micro-batch as one row of ``T`` tokens whose positions restart at every document, and hands
the model the boundaries as torchtitan's :class:`VarlenMetadata` (:func:`packed_metadata`, built from the
packed batch's ``cu_seqlens`` on the host: no device sync). The inner attention of every layer is chosen once,
by device and compute dtype (:func:`inner_attention_config`):

- on CUDA computing in bfloat16, torchtitan's own ``VarlenAttention`` (flash / cuDNN variable-length kernels),
  or on a torch whose ``varlen_attn`` lacks the arguments it passes (2.11) the same kernel called directly
  (:func:`posttrain.torchtitan.compat.varlen_attention_config`). Both cast q/k/v to bfloat16, so they are used
  only when the compute dtype is bfloat16: with ``engine.dtype=fp32`` (or fp16) on CUDA the engine takes
  :class:`PackedSDPA` instead and warns that it is slow, as the FSDP engine's packed attention does;
- elsewhere, :class:`PackedSDPA`: causal ``scaled_dot_product_attention`` on each document separately, in the
  dtype q/k/v arrive in. torchtitan 0.3.0 has nothing that trains on a CPU here (its varlen attention calls
  CUDA kernels, flex attention has no CPU backward, and SDPA is refused for language models). The choice is
  logged.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from torchtitan.models.common.attention import VarlenMetadata
from torchtitan.protocols.module import Module

from .compat import varlen_attention_config

logger = logging.getLogger(__name__)


class PackedSDPA(Module):
    """Inner attention (B=1, T, N, H) -> (1, T, N, H), causal inside each document of the packed row."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"packed attention expects one packed row, got batch size {q_BLNH.shape[0]}")
        bounds = attention_masks.cu_seq_q_host
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (1, N, T, H)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:end],
                    k[:, :, start:end],
                    v[:, :, start:end],
                    is_causal=True,
                    scale=scale,
                    enable_gqa=enable_gqa,
                )
            )
        return torch.cat(outs, dim=2).transpose(1, 2)


def inner_attention_config(device: torch.device, dtype: torch.dtype) -> Module.Config:
    """torchtitan's varlen attention on CUDA computing in bfloat16 (``dtype``); :class:`PackedSDPA` elsewhere
    (logged; warned on CUDA, where it is slow)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        return varlen_attention_config()
    if device.type == "cuda":
        warnings.warn(
            f"torchtitan engine on CUDA computing in {dtype}: torchtitan's varlen attention casts q/k/v to "
            "bfloat16, so packed attention runs one SDPA call per document in the compute dtype instead "
            "(exact, slow): set engine.dtype=bfloat16 for the varlen kernel (engine.model_dtype keeps fp32 "
            "master weights)",
            RuntimeWarning,
            stacklevel=2,
        )
        return PackedSDPA.Config()
    logger.info(
        "torchtitan engine on %s: packed attention runs posttrain's per-document SDPA (torchtitan's varlen "
        "attention needs CUDA)",
        device.type,
    )
    return PackedSDPA.Config()


def packed_metadata(cu_seqlens: list[int], device: torch.device) -> VarlenMetadata:
    """torchtitan's varlen metadata for one packed row with document boundaries ``cu_seqlens``."""
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    return VarlenMetadata(cu, cu, longest, longest, tuple(cu_seqlens))
