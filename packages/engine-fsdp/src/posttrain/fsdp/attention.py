"""Attention over packed sequences for Hugging Face models, with no padding token computed.

The engine runs a micro-batch as one row of ``T`` tokens (batch size 1) and passes the sequence boundaries
``cu_seq_lens_q`` / ``max_length_q`` through the model's ``**kwargs`` down to the attention function
registered here under :data:`ATTN_IMPLEMENTATION`. That function attends causally inside each sequence only:

- on CUDA in fp16/bf16 it calls ``torch.nn.attention.varlen.varlen_attn`` (flash / cuDNN variable-length
  kernels). Its causal switch changed between torch releases: 2.10 takes ``is_causal=True``, 2.11 and later
  take ``window_size=(-1, 0)``; the signature is inspected once to pick the right one. When the installed
  torch has no ``enable_gqa`` argument the key/value heads are repeated to the query heads first.
- elsewhere (CPU, fp32) it loops over the sequences and calls ``scaled_dot_product_attention(is_causal=True)``
  on each, which is exact and never builds a ``T x T`` mask. On CUDA that loop is slow (a kernel per sequence
  and layer, and a host sync for the boundaries), so taking it there warns once, naming the cause and the fix
  (:func:`fallback_reason`).

Under autocast q, k and v are first cast to the autocast dtype, as autocast does for SDPA. This is what makes
a one-process engine (no process group: the fp32 module runs under ``torch.autocast``) attend like FSDP2's
mixed precision: HF's RoPE multiplies the bf16 projections by fp32 cos/sin (computed in the dtype of the fp32
residual stream), so q and k would otherwise reach attention in fp32 and miss the varlen kernel.

Without ``cu_seq_lens_q`` (the padded path, used to check the packed one) the call goes to HF's SDPA attention
with whatever 4-D mask the caller built. Because the implementation name is not registered with HF's mask
interface, HF hands the caller's mask through unchanged (``None`` in packed mode): no mask is ever built for
the packed stream.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "posttrain_packed"
"""Name the engine registers with ``transformers.AttentionInterface`` and sets on the model config."""


def register_packed_attention() -> str:
    """Register :func:`packed_attention_forward` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    _varlen_api()  # resolve eagerly: compiled decoder layers then never trace the signature inspection
    return ATTN_IMPLEMENTATION


_VARLEN_API: dict[str, tuple[Any, bool, bool] | None] = {}
"""Cache of :func:`_resolve_varlen_api`, filled on first use (a plain dict, so compiled layers read it)."""


def _resolve_varlen_api() -> tuple[Any, bool, bool] | None:
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:  # older torch: per-sequence SDPA
        return None
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "is_causal" in params, "enable_gqa" in params


def _varlen_api() -> tuple[Any, bool, bool] | None:
    """(varlen_attn, takes is_causal, takes enable_gqa), or None when this torch has no varlen attention."""
    if "api" not in _VARLEN_API:
        _VARLEN_API["api"] = _resolve_varlen_api()
    return _VARLEN_API["api"]


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when packed attention on ``device`` in ``dtype`` runs through the variable-length kernel."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _varlen_api() is not None


def fallback_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why packed attention in ``dtype`` on ``device`` would take the slow per-sequence loop where it should
    not, and the fix; None when it runs the varlen kernel, or off CUDA (where the loop is the
    implementation)."""
    if device.type != "cuda" or varlen_available(device, dtype):
        return None
    if _varlen_api() is None:
        return (
            f"torch {torch.__version__} has no torch.nn.attention.varlen, so packed attention on CUDA runs "
            "one SDPA call per sequence (slow): install torch >= 2.10"
        )
    return (
        f"packed attention on CUDA got {dtype} q/k/v; the varlen kernel takes only float16/bfloat16, so it "
        "runs one SDPA call per sequence (slow): set engine.dtype=bfloat16 (the compute dtype; "
        "engine.model_dtype keeps the fp32 master weights)"
    )


_WARNED: set[str] = set()
"""Fallback reasons already warned about in this process."""


def _warn_fallback(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(reason, RuntimeWarning, stacklevel=3)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's on this device when it is enabled, else the query's."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D), causal inside each sequence."""
    varlen_attn, has_is_causal, has_gqa = _varlen_api()  # type: ignore[misc]
    kwargs: dict[str, Any] = {"scale": scale}
    if has_is_causal:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float | None, dropout: float
) -> torch.Tensor:
    """q (1, Hq, T, D), k/v (1, Hkv, T, D) -> (T, Hq, D): causal SDPA on each sequence separately."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for start, end in zip(cu[:-1], cu[1:]):
        o = F.scaled_dot_product_attention(
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: (1, H, T, D) inputs -> ((1, T, H, D) output, None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"sliding_window={kwargs['sliding_window']} attention is not implemented for packed "
            "sequences: use a model config with use_sliding_window=false"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch size {query.shape[0]}")
    dtype = _compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if varlen_available(query.device, dtype):
        if dropout > 0:
            raise ValueError(
                f"attention dropout {dropout} is not supported by the varlen kernel: set the model "
                "config's attention_dropout to 0"
            )
        max_len = int(kwargs["max_length_q"])
        out = _varlen(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu.to(torch.int32),
            max_len,
            scaling,
        )
    else:
        reason = fallback_reason(query.device, dtype)
        if reason is not None:
            _warn_fallback(reason)
        out = _per_sequence(query, key, value, cu.tolist(), scaling, dropout)
    return out.unsqueeze(0), None
