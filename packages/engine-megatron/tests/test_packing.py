"""``pack_micro_batch``: the THD stream a micro-batch becomes, its padding and its sequence bounds."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.batch import PackedBatch


@pytest.mark.parametrize(
    "lengths,multiple,want_cu,want_max",
    [
        ([5, 3, 1], 1, [0, 5, 8, 9], 5),
        ([5, 3, 1], 4, [0, 5, 8, 9, 12], 5),
        ([5, 3, 1], 16, [0, 5, 8, 9, 16], 7),  # the padding, a sequence of its own, is the longest
    ],
)
def test_padding_and_bounds(megatron_env, lengths, multiple, want_cu, want_max):
    from posttrain.megatron.packing import pack_micro_batch

    g = torch.Generator().manual_seed(0)
    mb = PackedBatch.from_sequences([torch.randint(1, 50, (n,), generator=g) for n in lengths])
    packed = pack_micro_batch(mb, multiple, torch.device("cpu"))
    params = packed.packed_seq_params
    assert params.cu_seqlens_q.tolist() == want_cu and params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == want_max
    assert packed.num_tokens == sum(lengths) and packed.input_ids.shape == (1, want_cu[-1])
    assert torch.equal(packed.input_ids[0, : sum(lengths)], mb.input_ids)
    assert packed.input_ids[0, sum(lengths) :].eq(0).all()
    assert packed.position_ids[0].tolist() == [i for a, b in zip(want_cu, want_cu[1:]) for i in range(b - a)]
