"""Context parallelism (CP) for packed THD micro-batches without Transformer Engine.

**Split** (Megatron-Core's and Transformer Engine's load balancing for THD): every sequence is padded to a
multiple of ``2*cp`` and cut into ``2*cp`` chunks of ``c`` tokens; CP rank ``r`` holds chunks ``r`` and
``2*cp-1-r`` (one early, one late chunk, so every rank does the same causal-attention work). A rank's stream
is its two chunks of each sequence, in sequence order. Megatron-Core's THD RoPE (``_apply_rotary_pos_emb_thd``
with ``cu_seqlens_q_padded``) gives those rows the positions ``[r*c, (r+1)*c)`` and
``[(2cp-1-r)*c, (2cp-r)*c)`` of their sequence, which is where this split puts them. Under sequence
parallelism one extra padding sequence makes the stream a multiple of ``2*cp*tp``, so each rank's stream
splits evenly over TP.

**Attention** ("all-gather KV", Transformer Engine's ``cp_comm_type='all_gather'``): keys and values are
all-gathered over the CP group (the backward reduce-scatters their gradients back to the ranks that own them).
Query chunk ``j`` of a sequence (positions ``[j*c, (j+1)*c)``) attends to the key prefix ``[0, (j+1)*c)`` of
its sequence with a causal mask aligned to the bottom right (query ``i`` of the chunk sees keys
``0 .. j*c+i``).
:class:`AttentionPlan` holds the rows of the gathered keys that form each local chunk's prefix, so the chunks
run as one variable-length batch (:func:`varlen_causal_attention`).

**Outputs**: per-row results (log-probs, entropy, values) come out in the rank's row order;
:meth:`CpLayout.to_packed` all-gathers them over CP and puts them back in packed token order. Every CP rank
then computes the same loss on the same gathered values, so the gather's backward keeps only this rank's
slice.
Per-token inputs that cross chunk boundaries (the next-token targets, their temperatures) are computed on
whole sequences first and laid out as this rank's rows with :meth:`CpLayout.to_rows`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class AttentionPlan:
    """This rank's query chunks and the key prefix each one attends to."""

    kv_index: torch.Tensor
    """(T_kv,) rows of the CP-gathered keys/values: each local chunk's key prefix, chunk after chunk."""
    cu_seqlens_q: torch.Tensor
    """(2B+1,) int32 boundaries of the local query chunks (two per sequence) in this rank's stream."""
    cu_seqlens_k: torch.Tensor
    """(2B+1,) int32 boundaries of the key prefixes in ``kv_index``."""
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass
class CpPackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` plus the plan :class:`~.attention.VarlenDotProductAttention` runs under
    CP."""

    cp_plan: AttentionPlan | None = None


@dataclass
class CpLayout:
    """Where the tokens of one micro-batch live across the CP ranks."""

    group: Any
    """The CP process group."""
    local_index: torch.Tensor
    """(T_local,) position in the padded stream of each of this rank's rows."""
    real_index: torch.Tensor
    """(T,) position in the padded stream of each real token (packed order)."""
    packed_rows: torch.Tensor
    """(T,) row of the CP-gathered (cp * T_local) rows that holds each real token."""

    def to_rows(self, per_token: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """A (T,) per-token tensor in packed order as this rank's (T_local,) rows (``fill`` at padding)."""
        padded = per_token.new_full((self.num_padded,), fill)
        padded[self.real_index.to(per_token.device)] = per_token
        return padded[self.local_index.to(per_token.device)]

    def to_packed(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's (T_local, ...) results gathered over CP, as (T, ...) in packed token order.

        Backward keeps this rank's slice of the gradient: every CP rank computes the same loss from the
        gathered values."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        gathered = gather_from_sequence_parallel_region(
            rows, tensor_parallel_output_grad=False, group=self.group
        )
        return gathered[self.packed_rows.to(rows.device)]

    @property
    def num_padded(self) -> int:
        return self.local_index.numel() * self.group.size()


@dataclass
class CpSplit:
    """The index arithmetic of one micro-batch's split, for one CP rank (CPU tensors)."""

    padded: torch.Tensor
    """(B',) padded sequence lengths (multiples of ``2*cp``), plus the sequence-parallel padding sequence if
    any."""
    actual: torch.Tensor
    """(B',) real sequence lengths (the padding sequence counts as real)."""
    offset: torch.Tensor
    """(T_pad,) position of each padded-stream token in its sequence."""
    gathered_row: torch.Tensor
    """(T_pad,) row of each padded-stream token in the CP-gathered (cp * T_local) rows."""
    local_index: torch.Tensor
    """(T_local,) padded-stream position of each of this rank's rows."""
    real_index: torch.Tensor
    """(T,) padded-stream position of each real token."""
    plan: AttentionPlan


def _rows_by_position(padded: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position of the padded stream: its owning rank, its row in the owner's stream, its offset in
    its sequence."""
    starts = torch.cumsum(padded, 0) - padded
    seq = torch.repeat_interleave(torch.arange(padded.numel()), padded)
    offset = torch.arange(int(padded.sum())) - starts[seq]
    chunk = (padded // (2 * cp))[seq]
    j = offset // chunk
    late = j >= cp
    owner = torch.where(late, 2 * cp - 1 - j, j)
    local_row = starts[seq] // cp + offset - j * chunk + late * chunk
    return owner, local_row, offset


def _attention_plan(padded: torch.Tensor, gathered_row: torch.Tensor, cp: int, rank: int) -> AttentionPlan:
    """Query chunks ``rank`` and ``2*cp-1-rank`` of every sequence and the key prefix each one sees."""
    starts = torch.cumsum(padded, 0) - padded
    chunk = padded // (2 * cp)
    q_lens = chunk.repeat_interleave(2)
    k_lens = torch.stack([(rank + 1) * chunk, (2 * cp - rank) * chunk], 1).flatten()
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_lens, 0)])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(k_lens, 0)])
    first = starts.repeat_interleave(2)  # each chunk's key prefix starts at its sequence's start
    prefix = torch.repeat_interleave(first - cu_k[:-1], k_lens) + torch.arange(int(cu_k[-1]))
    return AttentionPlan(
        kv_index=gathered_row[prefix],
        cu_seqlens_q=cu_q.to(torch.int32),
        cu_seqlens_k=cu_k.to(torch.int32),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(k_lens.max()),
    )


def plan_split(cu_seqlens: torch.Tensor, sp_multiple: int, cp: int, rank: int) -> CpSplit:
    """Rank ``rank``'s share of the sequences ``cu_seqlens`` under ``cp``-way CP; the padded stream is a
    multiple of ``2 * cp * sp_multiple`` (``sp_multiple``: the TP size under sequence parallelism, else 1,
    times 16 with FP8: ``McoreEngineConfig.token_multiple``)."""
    cu = cu_seqlens.long().cpu()
    lens = cu[1:] - cu[:-1]
    padded = (lens + 2 * cp - 1) // (2 * cp) * (2 * cp)
    extra = (-int(padded.sum())) % (2 * cp * sp_multiple)
    if extra:
        padded = torch.cat([padded, torch.tensor([extra])])
    owner, local_row, offset = _rows_by_position(padded, cp)
    t_local = offset.numel() // cp
    gathered_row = owner * t_local + local_row
    mine = owner == rank
    local_index = torch.empty(t_local, dtype=torch.long)
    local_index[local_row[mine]] = torch.nonzero(mine).squeeze(1)
    starts = torch.cumsum(padded, 0) - padded
    real_index = torch.repeat_interleave(starts[: lens.numel()] - cu[:-1], lens) + torch.arange(int(cu[-1]))
    return CpSplit(
        padded=padded,
        actual=torch.cat([lens, padded[lens.numel() :]]),
        offset=offset,
        gathered_row=gathered_row,
        local_index=local_index,
        real_index=real_index,
        plan=_attention_plan(padded, gathered_row, cp, rank),
    )


def _cumsum0(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(x, 0)]).to(torch.int32).to(device)


def split_micro_batch(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, sp_multiple: int, group: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, CpPackedSeqParams, CpLayout]:
    """This CP rank's ``(1, T_local)`` token ids and positions, the packed-sequence params (``cu_seqlens_q``:
    real lengths; ``cu_seqlens_q_padded``: the padded sequences Megatron's RoPE splits) and the layout."""
    split = plan_split(cu_seqlens, sp_multiple, group.size(), group.rank())
    ids = torch.zeros(split.offset.numel(), dtype=input_ids.dtype)
    ids[split.real_index] = input_ids.cpu()
    plan = split.plan
    plan.kv_index, plan.cu_seqlens_q, plan.cu_seqlens_k = (
        t.to(device) for t in (plan.kv_index, plan.cu_seqlens_q, plan.cu_seqlens_k)
    )
    max_len = int(split.padded.max())
    params = CpPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=_cumsum0(split.actual, device),
        cu_seqlens_kv=_cumsum0(split.actual, device),
        cu_seqlens_q_padded=_cumsum0(split.padded, device),
        cu_seqlens_kv_padded=_cumsum0(split.padded, device),
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        cp_plan=plan,
    )
    layout = CpLayout(
        group,
        split.local_index.to(device),
        split.real_index.to(device),
        split.gathered_row[split.real_index].to(device),
    )
    local = split.local_index
    return ids[local].to(device)[None], split.offset[local].to(device)[None], params, layout


def _has_varlen() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each query segment ``cu_q[b]:cu_q[b+1]`` to its key segment ``cu_k[b]:cu_k[b+1]``,
    aligned to the bottom right: with ``Lq`` queries and ``Lk`` keys, query ``i`` sees keys ``0 .. i+Lk-Lq``.

    ``(T_q, heads, d)`` queries, ``(T_k, heads, d)`` keys/values. On CUDA in bf16/fp16: one
    ``torch.nn.attention.varlen.varlen_attn`` call (flash attention; ``window_size=(-1, 0)`` is its causal
    mode, which flash aligns to the bottom right). Elsewhere SDPA per segment with that mask written out
    (SDPA's ``is_causal`` is aligned to the top left when ``Lq != Lk``)."""
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0 and _has_varlen():
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))
    out = torch.empty_like(query)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[b : b + 2], bounds_k[b : b + 2]
        q, k, v = query[q0:q1].transpose(0, 1), key[k0:k1].transpose(0, 1), value[k0:k1].transpose(0, 1)
        mask = None
        if q1 - q0 != k1 - k0:
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=query.device)
            mask = mask.tril((k1 - k0) - (q1 - q0))
        out[q0:q1] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale
        ).transpose(0, 1)
    return out


def gather_keys_values(
    key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each local query chunk's key/value prefix, from this rank's (T_local, groups, d) keys and values
    all-gathered over CP (backward: reduce-scatter, so each rank gets the gradient of the keys it owns)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    out = []
    for t in (key, value):
        full = gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
        out.append(full.index_select(0, plan.kv_index))
    return out[0], out[1]
