"""Packed (THD) micro-batches for Megatron-Core and vocab-parallel log-probs / entropy on sharded logits.

A micro-batch's sequences are fed as one ``(1, T)`` stream with ``PackedSeqParams(qkv_format='thd')``: RoPE
restarts at each ``cu_seqlens`` boundary and attention stays inside each sequence. Under sequence parallelism
the stream is split over TP ranks, so ``T`` is padded to a multiple of the TP size with one extra padding
sequence whose outputs are dropped. Under context parallelism each CP rank gets its load-balanced chunks of
every sequence instead (:mod:`.context_parallel`); next-token targets are formed on whole sequences before the
split, and the per-row results are gathered back to the packed order.

Logits come out sharded over the vocabulary (``V / tp`` columns per TP rank). With ``m`` the global max and
``Z = sum_v exp(l_v - m)`` (an all-reduce), ``log p(y) = l_y - m - log Z`` where ``l_y`` is contributed by the rank
owning ``y``, and ``H = log Z - sum_v p_v (l_v - m)``. The all-reduces are Megatron's
``reduce_from_tensor_model_parallel_region`` (sum forward, identity backward), so gradients are exact.

The fp32 part runs ``chunk_size`` rows at a time (``engine.entropy_from_logits_chunk_size``), under activation
checkpointing when gradients are on: autograd keeps only the logits in the compute dtype and recomputes each
chunk's softmax (and its all-reduces, in the same order on every TP rank) in backward, so the fp32 working set
is one chunk, not several full ``(T, V/tp)`` copies. Rows are independent, so the chunk size changes no result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.core.batch import PackedBatch

from .context_parallel import CpLayout, split_micro_batch


@dataclass
class PackedInput:
    """One micro-batch laid out for the model."""

    input_ids: torch.Tensor
    """(1, T_pad) token ids."""
    position_ids: torch.Tensor
    """(1, T_pad) positions, restarting per sequence."""
    packed_seq_params: object
    """Megatron ``PackedSeqParams`` (thd) over the padded stream."""
    num_tokens: int
    """Real tokens of the micro-batch (without CP, outputs beyond this index are padding)."""
    cp: CpLayout | None = None
    """Under context parallelism, where the rows of this rank's stream sit in the micro-batch."""

    def output_rows(self, output: torch.Tensor) -> torch.Tensor:
        """The rows of a ``(1, T_pad, ...)`` model output that carry results: the real tokens without CP, this
        rank's whole stream under CP (:meth:`CpLayout.to_packed` drops its padding later)."""
        return output[0] if self.cp is not None else output[0, : self.num_tokens]


def pack_micro_batch(
    mb: PackedBatch, pad_multiple: int, device: torch.device, cp_group: object = None
) -> PackedInput:
    """``mb`` as one THD stream padded to a multiple of ``pad_multiple`` tokens; with a ``cp_group`` of more than
    one rank, this CP rank's part of it (``pad_multiple`` is then the sequence-parallel TP size or 1)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cp_group is not None and cp_group.size() > 1:
        ids, pos, params, layout = split_micro_batch(
            mb.input_ids, mb.cu_seqlens, pad_multiple, cp_group, device
        )
        return PackedInput(ids, pos, params, mb.input_ids.numel(), layout)
    ids, pos, cu = mb.input_ids, mb.position_ids, mb.cu_seqlens.to(torch.int32)
    total = ids.numel()
    pad = (-total) % pad_multiple
    if pad:
        ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype, device=ids.device)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)])
        cu = torch.cat([cu, torch.tensor([total + pad], dtype=torch.int32, device=cu.device)])
    max_len = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    return PackedInput(ids.to(device)[None], pos.to(device)[None], params, total)


def _tp_sum(x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp_group: object, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) per row of TP-sharded ``logits`` (N, V/tp) in float32."""
    logits = logits.float()
    with torch.no_grad():
        row_max = logits.max(dim=-1).values
        if torch.distributed.get_world_size(tp_group) > 1:
            torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max[:, None]
    log_z = torch.log(_tp_sum(shifted.exp().sum(dim=-1)))
    local = targets - vocab_start
    owned = (local >= 0) & (local < logits.size(-1))
    picked = shifted.gather(-1, local.clamp(0, logits.size(-1) - 1)[:, None]).squeeze(-1) * owned
    log_probs = _tp_sum(picked) - log_z
    entropy = None
    if with_entropy:
        probs = torch.exp(shifted - log_z[:, None])
        entropy = log_z - _tp_sum((probs * shifted).sum(dim=-1))
    return log_probs, entropy


def _chunk_outputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temp: torch.Tensor | None,
    vocab_start: int,
    tp_group: object,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vocab_parallel_logprobs` of one chunk of rows, the temperature applied in float32."""
    logits = logits.float()
    if temp is not None:
        logits = logits / temp[:, None]
    return vocab_parallel_logprobs(logits, targets, vocab_start, tp_group, with_entropy)


def chunked_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temp: torch.Tensor | None,
    vocab_start: int,
    tp_group: object,
    with_entropy: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) per row, ``chunk_size`` rows at a time, each chunk recomputed in backward
    when gradients are on (every TP rank must pass the same number of rows, as the all-reduces require)."""
    from torch.utils.checkpoint import checkpoint

    lps, ents = [], []
    for start in range(0, logits.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        args = (logits[rows], targets[rows], None if temp is None else temp[rows], vocab_start, tp_group)
        if torch.is_grad_enabled() and logits.requires_grad:
            lp, ent = checkpoint(
                _chunk_outputs, *args, with_entropy, use_reentrant=False, preserve_rng_state=False
            )
        else:
            lp, ent = _chunk_outputs(*args, with_entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # no rows
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, empty if with_entropy else None
    return torch.cat(lps), torch.cat(ents) if with_entropy else None


def token_outputs(
    logits: torch.Tensor,
    mb: PackedBatch,
    vocab_start: int,
    tp_group: object,
    with_entropy: bool,
    cp: CpLayout | None = None,
    chunk_size: int = 2048,
) -> dict[str, torch.Tensor]:
    """Per-token ``log_probs`` (and ``entropy``) aligned with the tokens they describe, from (T, V/tp) logits,
    computed ``chunk_size`` rows at a time (:func:`chunked_logprobs`).

    Row ``t`` of ``logits`` predicts token ``t+1``, so it is divided by ``temperature[t+1]``, scored against
    ``input_ids[t+1]`` and the results shift one place right; each sequence's first token gets 0. Under CP the
    logits are this rank's rows: targets and temperatures are shifted on the whole micro-batch, laid out as
    those rows, and the results are gathered back to the packed order before the shift."""
    ids = mb.input_ids
    targets = torch.roll(ids, -1)
    temp = None
    if "temperature" in mb.fields:
        temp = torch.roll(mb.fields["temperature"].to(logits.device).float(), -1)
    if cp is not None:
        targets = cp.to_rows(targets)
        temp = None if temp is None else cp.to_rows(temp, fill=1.0)
    targets = targets.to(logits.device)
    lp, ent = chunked_logprobs(logits, targets, temp, vocab_start, tp_group, with_entropy, chunk_size)
    if cp is not None:
        lp = cp.to_packed(lp)
        ent = None if ent is None else cp.to_packed(ent)
    starts = mb.cu_seqlens[:-1].long().to(logits.device)
    out = {"log_probs": torch.roll(lp, 1).index_fill(0, starts, 0.0)}
    if ent is not None:
        out["entropy"] = torch.roll(ent, 1).index_fill(0, starts, 0.0)
    return out
