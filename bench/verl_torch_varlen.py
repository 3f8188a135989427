"""torch's variable-length flash attention for verl's packed ("remove padding") Hugging Face actor, where the
flash-attn package has no wheel (torch 2.11 + CUDA 13, the GPU image).

verl's ``use_remove_padding`` feeds the model one packed row, position ids that restart at 0 for each
sequence, and no attention mask. HF's ``flash_attention_2`` then finds the sequence boundaries from those
position ids and calls ``flash_attn_varlen_func``. This module registers the same computation
under :data:`NAME` with ``torch.nn.attention.varlen.varlen_attn`` (torch's flash kernel), so verl runs the
attention it is tuned for instead of SDPA over a block-diagonal mask. It changes nothing in verl: importing it
registers a name with transformers, which verl loads through its own plug-in hook::

    actor_rollout_ref.model.external_lib=verl_torch_varlen \
    +actor_rollout_ref.model.override_config.attn_implementation=torch_varlen

``python verl_torch_varlen.py`` checks it on a CUDA device against causal SDPA run sequence by sequence.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "torch_varlen"
"""The attention implementation name registered with transformers."""

_LAST: dict[str, Any] = {}
"""The boundaries of the last position-id tensor seen: every layer of one forward gets the same tensor."""


def _boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence starts (int32, with the total at the end) and the longest length, from packed
    position ids (1, T) that restart at 0 for each sequence. One host sync per forward, not per layer."""
    if _LAST.get("ids") is position_ids:
        return _LAST["cu"], _LAST["max"]
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1).to(torch.int32)
    total = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
    cu = torch.cat([starts, total])
    max_len = int((cu[1:] - cu[:-1]).max())
    _LAST.update(ids=position_ids, cu=cu, max=max_len)
    return cu, max_len


def _causal_kwargs() -> dict[str, Any]:
    """torch 2.10's varlen_attn takes ``is_causal``; 2.11 and later take ``window_size=(-1, 0)``."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}


def torch_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: (1, H, T, D) q/k/v of one packed row -> ((1, T, Hq, D), None)."""
    from torch.nn.attention.varlen import varlen_attn

    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(
            f"{NAME} attention takes one packed row with no mask (verl's use_remove_padding=True); got batch "
            f"{query.shape[0]} and a mask of shape "
            f"{None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    if dropout:
        raise ValueError(
            f"{NAME} attention has no dropout; got {dropout}: set the config's attention_dropout to 0"
        )
    cu, max_len = _boundaries(kwargs["position_ids"])
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **_causal_kwargs())
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, torch_varlen_forward)


def _check() -> None:
    """The registered function against causal SDPA per sequence, on CUDA in bf16 (GQA: 14 query, 2 kv
    heads)."""
    torch.manual_seed(0)
    lens = [5, 300, 1, 77, 1024]
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).cuda()
    T = pos.shape[1]
    q = torch.randn(1, 14, T, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got, _ = torch_varlen_forward(torch.nn.Module(), q, k, v, None, scaling=0.125, position_ids=pos)
    ref, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True, scale=0.125, enable_gqa=True
        )
        ref.append(o[0].transpose(0, 1))
        start += n
    err = (got[0].float() - torch.cat(ref).float()).abs().max().item()
    if err > 2e-2:
        raise SystemExit(f"{NAME}: max abs error {err:.3g} against per-sequence SDPA (bf16 bound 2e-2)")
    print(
        f"{NAME}: matches per-sequence causal SDPA on {len(lens)} packed sequences ({T} tokens), max abs "
        f"error {err:.2g}"
    )


if __name__ == "__main__":
    _check()
