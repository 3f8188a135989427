"""Helpers for per-token values in the packed layout of ``PackedBatch``.

Shapes: T = tokens of all sequences end to end, B = sequences. ``cu_seqlens`` (B+1,) delimits sequence ``i``
as tokens ``cu_seqlens[i]:cu_seqlens[i+1]``; ``seq_index`` (T,) says which sequence each token belongs to. A
mask (T,) is 1 on response (training-target) tokens. Moving to a right-padded (B, L) matrix and back lets the
time-recursive estimators (GAE, REINFORCE++) run one vectorised loop over positions, as verl does.
"""

from __future__ import annotations

import torch


def seq_index_from_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) int64 sequence id of every token."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def segment_sum(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """(B,) sum of ``values`` (T,) over each sequence."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked entries, with the unbiased (Bessel) variance, as verl's
    ``masked_whiten``; a single masked entry has variance 0."""
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    sq = ((values - mean) ** 2 * mask).sum() / count.clamp(min=1)
    var = sq * count / (count - 1) if count > 1 else sq
    return (values - mean) * torch.rsqrt(var + eps)


def to_padded(values: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """(T,) packed -> (B, L) right-padded, L = the longest sequence."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    width = int(lens.max()) if lens.numel() else 0
    seq_index = seq_index_from_cu(cu_seqlens)
    pos = torch.arange(values.numel(), device=values.device) - cu_seqlens[:-1].long()[seq_index]
    out = torch.full((lens.numel(), width), fill, dtype=values.dtype, device=values.device)
    out[seq_index, pos] = values
    return out


def from_padded(padded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(B, L) right-padded -> (T,) packed."""
    seq_index = seq_index_from_cu(cu_seqlens)
    pos = torch.arange(seq_index.numel(), device=padded.device) - cu_seqlens[:-1].long()[seq_index]
    return padded[seq_index, pos]


def last_token_positions(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(B,) index of each sequence's last masked token (-1 for a sequence with none)."""
    seq_index = seq_index_from_cu(cu_seqlens)
    positions = torch.arange(mask.numel(), device=mask.device)
    last = torch.full((cu_seqlens.numel() - 1,), -1, dtype=torch.long, device=mask.device)
    return last.scatter_reduce(0, seq_index, torch.where(mask > 0, positions, -1), reduce="amax")


def align_values(head_values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Value-head outputs at token t (the state after reading t) moved onto token t+1, the token generated in
    that state; each sequence's first token gets 0. The FSDP value engine returns head outputs; advantages and
    the critic loss use the aligned values."""
    aligned = torch.roll(head_values, 1, dims=0)
    return aligned.index_fill(0, cu_seqlens[:-1].to(device=aligned.device, dtype=torch.long), 0.0)
