"""The packed-batch contract: packing, selection, token-budget partitions and order restoration."""

import dataclasses

import pytest
import torch

from posttrain.core.batch import (
    PackedBatch,
    loss_context,
    make_micro_batches,
    partition_by_count,
    partition_by_tokens,
    restore_order,
)


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
    return PackedBatch.from_sequences(
        seqs, fields={"adv": [torch.full((n,), float(i)) for i, n in enumerate(lengths)]}
    )


def test_from_sequences_layout():
    b = PackedBatch.from_sequences([[5, 6, 7], [8, 9]], loss_masks=[[0, 1, 1], [0, 1]])
    assert b.cu_seqlens.tolist() == [0, 3, 5]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert b.seq_index().tolist() == [0, 0, 0, 1, 1]
    assert b.loss_mask.tolist() == [0, 1, 1, 0, 1]


def test_bad_batches_are_named():
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        PackedBatch.from_sequences([[1], []])
    b = PackedBatch.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="'adv' has 3 entries, expected 2"):
        PackedBatch(b.input_ids, b.position_ids, b.cu_seqlens, b.loss_mask, {"adv": torch.zeros(3)})


def test_select_keeps_fields_aligned():
    b = _batch([3, 5, 2])
    s = b.select([2, 0])
    assert s.seqlens == [2, 3]
    assert s.fields["adv"].tolist() == [2, 2, 0, 0, 0]
    assert torch.equal(s.input_ids[:2], b.input_ids[8:10])


@pytest.mark.parametrize("budget", [7, 10, 64])
def test_token_partitions_respect_budget_and_cover_all(budget):
    lengths = [7, 1, 3, 5, 2, 6, 4, 4]
    parts = partition_by_tokens(lengths, budget)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= budget for p in parts)
    assert len(parts) <= -(-sum(lengths) // budget) + 1


def test_too_long_sequence_names_fix():
    with pytest.raises(ValueError, match="raise max_token_len_per_gpu to at least 9"):
        partition_by_tokens([3, 9], 8)


def test_count_partitions():
    assert partition_by_count(5, 2) == [[0, 1], [2, 3], [4]]


def test_restore_order_roundtrip():
    b = _batch([4, 2, 6, 1, 3])
    parts = make_micro_batches(b, max_tokens=6, micro_batch_size=None, use_dynamic_bsz=True)
    micro = [b.select(p) for p in parts]
    outs = [m.input_ids.float() * 2 for m in micro]
    assert torch.equal(restore_order(parts, micro, outs), b.input_ids.float() * 2)


def test_loss_context_single_process():
    b = PackedBatch.from_sequences([[1, 2, 3], [4, 5]], loss_masks=[[0, 1, 1], [0, 1]])
    ctx = loss_context(b)
    assert (ctx.global_num_tokens, ctx.global_num_seqs, ctx.dp_size) == (3, 2, 1)


def test_dynamic_bsz_needs_budget():
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        make_micro_batches(_batch([2]), max_tokens=None, micro_batch_size=None, use_dynamic_bsz=True)


def test_seq_fields_follow_selection():
    b = _batch([3, 5, 2])
    b.seq_fields["uid"] = torch.tensor([10, 11, 12])
    assert b.select([2, 0]).seq_fields["uid"].tolist() == [12, 10]
    with pytest.raises(ValueError, match="seq_field 'score' has 2 entries, expected 3"):
        PackedBatch(
            b.input_ids, b.position_ids, b.cu_seqlens, b.loss_mask, seq_fields={"score": torch.zeros(2)}
        )


def test_host_lengths_follow_the_tensor_on_cpu_and_travel_with_to():
    b = PackedBatch.from_sequences([[1, 2, 3], [4, 5]])
    moved = b.to("cpu", non_blocking=True)
    assert moved.seqlens == [3, 2] and moved.host_cu_seqlens == [0, 3, 5]
    # a stale host list (e.g. from dataclasses.replace) is re-read from a CPU tensor, never trusted
    swapped = dataclasses.replace(b, cu_seqlens=torch.tensor([0, 1, 5], dtype=torch.int32))
    assert swapped.seqlens == [1, 4]
    with pytest.raises(ValueError, match="ends at 4"):
        dataclasses.replace(b, cu_seqlens=torch.tensor([0, 1, 4], dtype=torch.int32))
