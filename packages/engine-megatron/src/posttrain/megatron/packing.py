"""Packed (THD) micro-batches for Megatron-Core and vocab-parallel log-probs / entropy on sharded logits.

A micro-batch's sequences are fed as one ``(1, T)`` stream with ``PackedSeqParams(qkv_format='thd')``: RoPE
restarts at each ``cu_seqlens`` boundary and attention stays inside each sequence. Under sequence parallelism
the stream is split over TP ranks, so ``T`` is padded to a multiple of the TP size with one extra padding
sequence whose outputs are dropped. Under context parallelism each CP rank gets its load-balanced chunks of
every sequence instead (:mod:`.context_parallel`); next-token targets are formed on whole sequences before the
split, and the per-row results are gathered back to the packed order.

Logits come out sharded over the vocabulary (``V / tp`` columns per TP rank); :mod:`.head` turns them into
log-probs and entropy, ``engine.entropy_from_logits_chunk_size`` rows at a time, with a hand-written backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.core.batch import PackedBatch

from .context_parallel import CpLayout, split_micro_batch
from .head import vocab_parallel_argmax_hits, vocab_parallel_logprobs


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
    """``mb`` as one THD stream padded to a multiple of ``pad_multiple`` tokens; with a ``cp_group`` of more
    than one rank, this CP rank's part of it (``pad_multiple``: ``McoreEngineConfig.token_multiple``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cp_group is not None and cp_group.size() > 1:
        ids, pos, params, layout = split_micro_batch(
            mb.input_ids, mb.cu_seqlens, pad_multiple, cp_group, device
        )
        return PackedInput(ids, pos, params, mb.input_ids.numel(), layout)
    # nothing here reads the device: a read stalls the host until the previous micro-batch's backward ends
    ids, pos, cu = mb.input_ids, mb.position_ids, mb.cu_seqlens.to(torch.int32)
    total = ids.numel()
    pad = (-total) % pad_multiple
    if pad:
        ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype, device=ids.device)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)])
        cu = torch.cat([cu, cu[-1:] + pad])
    max_len = max(mb.max_seqlen, pad)  # the padding is a sequence of its own
    cu = cu.to(device)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    return PackedInput(ids.to(device)[None], pos.to(device)[None], params, total)


def token_outputs(
    logits: torch.Tensor,
    mb: PackedBatch,
    vocab_start: int,
    tp_group: object,
    with_entropy: bool,
    cp: CpLayout | None = None,
    chunk_size: int = 2048,
    with_accuracy: bool = False,
    use_compile: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token ``log_probs`` (and ``entropy``, and with ``with_accuracy`` ``correct``: 1.0 where the token
    is the argmax of the logits that predict it) aligned with the tokens they describe, from (T, V/tp) logits,
    computed ``chunk_size`` rows at a time (:func:`.head.vocab_parallel_logprobs`, its chunk math compiled
    with ``use_compile``; :func:`.head.vocab_parallel_argmax_hits`).

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
    lp, ent = vocab_parallel_logprobs(
        logits, targets, vocab_start, tp_group, with_entropy, temp, chunk_size, use_compile
    )
    per_row = {"log_probs": lp, "entropy": ent}
    if with_accuracy:
        per_row["correct"] = vocab_parallel_argmax_hits(logits, targets, vocab_start, tp_group, chunk_size)
    starts = mb.cu_seqlens[:-1].long().to(logits.device)
    out = {}
    for name, rows in per_row.items():
        if rows is not None:
            packed = rows if cp is None else cp.to_packed(rows)
            out[name] = torch.roll(packed, 1).index_fill(0, starts, 0.0)
    return out
