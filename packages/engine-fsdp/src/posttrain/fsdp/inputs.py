"""Model inputs for one micro-batch: the packed row (default) or a right-padded (B, S) batch.

Packed: ``input_ids`` and ``position_ids`` of shape (1, T), no attention mask, and the sequence boundaries as
``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments, which HF forwards to the attention function
(:mod:`posttrain.fsdp.attention`). With ``pad_to_length`` one filler sequence is appended so T is a multiple
of the bucket (stable shapes); its outputs are dropped.

Padded (``use_remove_padding=False``): each sequence is a row padded on the right to the longest one, with an
explicit 4-D boolean mask (causal and key-not-padding), and ``valid_index`` lists the real tokens' flat
positions in packed order so outputs come back on the packed stream. It computes the padding, and exists to
check the packed path against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core.batch import PackedBatch


@dataclass
class ModelInputs:
    """Keyword arguments for the HF forward, and how to map its outputs back to the micro-batch's tokens."""

    kwargs: dict[str, Any]
    """input_ids, position_ids, attention_mask and the packed-attention kwargs."""
    num_tokens: int
    """Real tokens of the micro-batch (outputs beyond this are filler)."""
    stream_ids: torch.Tensor
    """(T',) token ids of the stream the head scores (packed tokens, plus filler when padded to a bucket)."""
    valid_index: torch.Tensor | None = None
    """Padded mode: flat (B*S) indices of the real tokens in packed order."""


def packed_inputs(mb: PackedBatch, pad_to_multiple: int | None = None) -> ModelInputs:
    """One packed row; see the module docstring."""
    ids, pos, cu = mb.input_ids, mb.position_ids, mb.cu_seqlens.to(torch.int32)
    seqlens = mb.seqlens
    if pad_to_multiple:
        pad = -ids.numel() % pad_to_multiple
        if pad:
            ids = torch.cat([ids, ids.new_zeros(pad)])
            pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)])
            cu = torch.cat([cu, cu.new_tensor([ids.numel()])])
            seqlens = [*seqlens, pad]
    max_len = max(seqlens)
    kwargs = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": pos.unsqueeze(0),
        "attention_mask": None,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
    return ModelInputs(kwargs, mb.num_tokens, ids)


def padded_inputs(mb: PackedBatch) -> ModelInputs:
    """Right-padded (B, S) inputs with a 4-D boolean mask; see the module docstring."""
    device = mb.input_ids.device
    lens = torch.tensor(mb.seqlens, device=device)
    num_seqs, width = lens.numel(), int(lens.max())
    row = mb.seq_index().to(device)
    col = torch.arange(mb.num_tokens, device=device) - mb.cu_seqlens.to(device).long()[row]
    flat = row * width + col
    ids = torch.zeros(num_seqs * width, dtype=mb.input_ids.dtype, device=device).index_copy(
        0, flat, mb.input_ids
    )
    valid = torch.arange(width, device=device).unsqueeze(0) < lens.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = causal.unsqueeze(0) & valid.unsqueeze(1)
    kwargs = {
        "input_ids": ids.view(num_seqs, width),
        "position_ids": torch.arange(width, device=device).expand(num_seqs, width),
        "attention_mask": mask.unsqueeze(1),
    }
    return ModelInputs(kwargs, mb.num_tokens, mb.input_ids, valid_index=flat)
