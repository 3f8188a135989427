"""The HF rollout's attention: transformers' SDPA attention, minus the key/value copies of a masked decode
step.

With an attention mask, transformers' SDPA function repeats every key/value head to the query heads
(``repeat_kv``) so that SDPA keeps an efficient kernel; in a decode step over a static cache of ``L`` slots
that copies the whole cache, ``num_key_value_groups`` times over, in every layer and step. For a one-token
query this function instead folds the query heads of each group into the query-length dimension:
``(B, Hq, 1, D)`` becomes ``(B, Hkv, Hq / Hkv, D)`` against the ``(B, Hkv, L, D)`` cache, with the
``(B, 1, 1, L)`` mask broadcast. Each query attends to exactly the keys it did before, in one SDPA call, with
no copy. Everything else (prefill, no mask, no grouping) goes to transformers' ``sdpa_attention_forward``.

:func:`register` adds it to transformers' attention and mask interfaces under :data:`ATTN_IMPLEMENTATION`
(masks are SDPA's), and the rollout switches an ``sdpa`` model to it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "posttrain_rollout_sdpa"
"""Name registered with ``transformers.AttentionInterface`` and ``AttentionMaskInterface``."""


def rollout_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: (B, H, q, D) inputs -> ((B, q, Hq, D) output, None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    folds = (
        q_len == 1
        and groups > 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and attention_mask.shape[2] == 1
        and key.shape[-1] == value.shape[-1]
        and kwargs.get("position_bias") is None
    )
    if not folds:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # query head h = kv head h // groups (repeat_kv's order), so a reshape groups them under their kv head
    folded = query.reshape(batch, key.shape[1], groups, dim)
    out = F.scaled_dot_product_attention(
        folded, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def register() -> str:
    """Register :func:`rollout_attention_forward` and SDPA's mask builder (idempotent); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, rollout_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
