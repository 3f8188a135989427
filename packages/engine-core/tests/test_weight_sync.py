"""Bucketed weight sync: round trip, bucket boundaries, checksums catch corruption, order and completeness."""

import pytest
import torch

from posttrain.core.checksum import _tables, padded
from posttrain.core.weight_sync import (
    Bucket,
    BucketReceiver,
    BucketSender,
    InProcessTransport,
    WeightSyncError,
    bucket_checksums,
    tensor_checksum,
    unpack_bucket,
)


def _weights():
    g = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(3 + i, 7, generator=g)) for i in range(6)] + [("ids", torch.arange(5))]


def test_roundtrip_across_buckets_and_dtype_cast():
    got = []
    receiver = BucketReceiver(lambda ts: got.extend((n, t.clone()) for n, t in ts))
    report = BucketSender(InProcessTransport(receiver), bucket_bytes=256, dtype=torch.bfloat16).send(
        _weights()
    )
    assert receiver.finish() == 7 and report.num_buckets > 2
    for (name, ref), (gname, gt) in zip(_weights(), got):
        assert name == gname
        expected = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
        assert gt.dtype == expected.dtype and torch.equal(gt, expected)


def test_corrupted_bucket_is_rejected():
    def corrupt_then_receive(bucket: Bucket):
        bucket.buffer[bucket.metas[0].offset] ^= 1
        receiver(bucket)

    receiver = BucketReceiver(lambda ts: None)
    with pytest.raises(WeightSyncError, match="checksum mismatch for 'w0'"):
        BucketSender(InProcessTransport(corrupt_then_receive), 4096).send(_weights())


def test_lost_bucket_and_incomplete_sync_raise():
    receiver = BucketReceiver(lambda ts: None)
    sent = []
    BucketSender(InProcessTransport(sent.append), 256).send(_weights())
    with pytest.raises(WeightSyncError, match="expected bucket 0"):
        receiver(sent[1])
    receiver2 = BucketReceiver(lambda ts: None)
    sent2 = []
    sender = BucketSender(
        InProcessTransport(lambda b: sent2.append(Bucket(b.buffer.clone(), b.metas, b.index, b.is_last))), 256
    )
    sender.send(_weights())
    for b in sent2[:-1]:
        receiver2(b)
    with pytest.raises(WeightSyncError, match="incomplete"):
        receiver2.finish()


def test_tensor_larger_than_bucket_names_fix():
    with pytest.raises(ValueError, match="raise rollout.update_weights_bucket_megabytes"):
        BucketSender(InProcessTransport(lambda b: None), 256).send([("big", torch.zeros(100))])
    with pytest.raises(ValueError, match="use at least 256"):
        BucketSender(InProcessTransport(lambda b: None), 64)


def test_checksum_sees_swaps_and_bit_flips():
    t = torch.arange(10, dtype=torch.float32)
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    flipped = t.clone()
    flipped.view(torch.int32)[3] ^= 1
    c = tensor_checksum(t)
    assert c == tensor_checksum(t.clone())
    assert c != tensor_checksum(swapped) and c != tensor_checksum(flipped)
    assert tensor_checksum(torch.ones(3, dtype=torch.bfloat16)) != tensor_checksum(
        torch.ones(2, dtype=torch.bfloat16)
    )


@pytest.mark.parametrize("chunk_rows", [1, 3, 1 << 21])
def test_bucket_checksums_equal_the_per_tensor_checksums(chunk_rows):
    """One pass over a bucket gives each span the checksum of its bytes alone: odd and empty sizes, garbage in
    the gaps between spans, spans across scan-chunk boundaries, fewer rows than the matrix multiply takes."""
    g = torch.Generator().manual_seed(1)
    buffer = torch.randint(0, 256, (1 << 15,), dtype=torch.uint8, generator=g)
    spans, tensors, offset = [], [], 0
    for i, n in enumerate([0, 1, 2, 3, 5, 7, 64, 1000, 4097, 256, 6, 0, 33, 5000]):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        buffer[offset : offset + n] = t
        end = padded(offset + n)
        buffer[offset + n : end] = 0  # the sender's contract: zero bytes to the next row
        spans.append((offset, n))
        tensors.append(t)
        offset = end + (0, 256, 1024)[i % 3]
    assert bucket_checksums(buffer, spans, chunk_rows) == [tensor_checksum(t) for t in tensors]
    # the same layout again (its scan plan cached) over other bytes: the new bytes' checksums
    for (offset, n), t in zip(spans, tensors):
        t.random_(0, 256, generator=g)
        buffer[offset : offset + n] = t
    assert bucket_checksums(buffer, spans, chunk_rows) == [tensor_checksum(t) for t in tensors]
    small = torch.zeros(1024, dtype=torch.uint8)
    small[:300] = torch.randint(1, 256, (300,), dtype=torch.uint8, generator=g)
    for n in (300, 10, 300):  # layouts that share their starts
        small[n:] = 0
        assert bucket_checksums(small, [(0, n)], chunk_rows) == [tensor_checksum(small[:n])], n
    with pytest.raises(ValueError, match="multiples of 256 bytes"):
        bucket_checksums(buffer, [(4, 4)])
    with pytest.raises(WeightSyncError, match="partial transfer"):
        bucket_checksums(buffer[:600], [(512, 8)])


def test_every_byte_position_changes_its_row_hash():
    """The row hash's coefficient of each of the 256 byte positions is non-zero modulo 2**56, so changing any
    one byte by any amount changes the checksum; checked on the float64-free integer math and on real
    flips."""
    w, c = (x.tolist() for x in _tables(torch.device("cpu")))
    for k in range(256):
        coeff = sum(ci * wk for ci, wk in zip(c, w[k])) % 2**64
        assert coeff % 2**56 != 0, k
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (700,), dtype=torch.uint8, generator=g)
    base = tensor_checksum(t)
    for k in (0, 1, 255, 256, 511, 699):
        for delta in (1, 128, 255):
            flipped = t.clone()
            flipped[k] = (int(t[k]) + delta) % 256
            assert tensor_checksum(flipped) != base, (k, delta)
    assert tensor_checksum(torch.cat([t[256:512], t[:256], t[512:]])) != base  # two rows swapped


def test_sender_zeroes_the_row_tail_and_casts_in_the_copy():
    """A bucket that held other bytes before: each tensor's checksum in the metadata is the checksum of the
    tensor alone, cast to the rollout dtype (odd bf16 sizes, 1-byte dtypes, a non-contiguous source)."""
    g = torch.Generator().manual_seed(2)
    weights = [
        ("odd", torch.randn(3, 5, generator=g)),
        ("t", torch.randn(6, 7, generator=g).t()),
        ("mask", torch.tensor([True, False, True])),
        ("b", torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g)),
        ("last", torch.randn(1, generator=g)),
    ]
    buffer = torch.full((4096,), 0xFF, dtype=torch.uint8)
    sent, got = [], []
    receiver = BucketReceiver(lambda ts: got.extend((n, t.clone()) for n, t in ts))

    def record(bucket: Bucket):
        sent.extend(bucket.metas)
        receiver(bucket)

    BucketSender(InProcessTransport(record), 4096, dtype=torch.bfloat16, buffer=buffer).send(weights)
    for (name, ref), meta, (_, out) in zip(weights, sent, got):
        want = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
        assert meta.checksum == tensor_checksum(want.contiguous()), name
        assert out.dtype == want.dtype and torch.equal(out, want), name


def test_a_sender_reused_across_syncs_packs_each_layout():
    """A sender keeps its buffer views between syncs: tensors that change shape or dtype at the same offsets,
    then the first layout again, each arrive exactly."""
    g = torch.Generator().manual_seed(3)
    first = [("x", torch.randn(4, 64, generator=g)), ("y", torch.randn(8, generator=g))]
    other = [("x", torch.randn(64, 4, generator=g)), ("y", torch.arange(8, dtype=torch.int32))]
    again = [("x", torch.randn(4, 64, generator=g)), ("y", torch.randn(8, generator=g))]
    got = []
    receiver = BucketReceiver(lambda ts: got.extend((n, t.clone()) for n, t in ts))
    sender = BucketSender(InProcessTransport(receiver), 4096)
    for stream in (first, other, again):
        got.clear()
        sender.send(stream)
        assert receiver.finish() == 2
        for (name, ref), (got_name, out) in zip(stream, got):
            assert got_name == name and out.dtype == ref.dtype and torch.equal(out, ref), name


def _padding_bytes(bucket: Bucket) -> torch.Tensor:
    return torch.cat(
        [bucket.buffer[m.offset + m.nbytes : m.offset + padded(m.nbytes)] for m in bucket.metas]
        + [torch.zeros(0, dtype=torch.uint8)]
    )


def test_padding_is_zero_in_every_bucket_of_a_shared_buffer_across_layouts():
    """One buffer carries every bucket of a sync: each bucket's padding bytes are zero even where the bucket
    before it (same sync) or the last sync's other layout left data, and the receiver verifies every tensor.
    Source dtypes change at the same offsets (fp32, fp16, int32) and the copy groups split there."""
    g = torch.Generator().manual_seed(5)
    odd = [(f"a{i}", torch.randn(37 + i, generator=g)) for i in range(6)]  # 74+ bf16 bytes: padded
    shifted = [(f"b{i}", torch.randn(128 + 3 * i, generator=g)) for i in range(6)]  # data where odd pads
    mixed = [
        ("h", torch.randn(37, generator=g).half()),
        ("i", torch.arange(37, dtype=torch.int32)),
        ("f", torch.randn(37, generator=g)),
        ("d", torch.randn(37, generator=g, dtype=torch.float64)),
    ]
    buffer = torch.full((1024,), 0xFF, dtype=torch.uint8)
    got, paddings, buckets = [], [], []
    receiver = BucketReceiver(lambda ts: got.extend((n, t.clone()) for n, t in ts))

    def record(bucket: Bucket):
        paddings.append(_padding_bytes(bucket))
        buckets.append(bucket.index)
        receiver(bucket)

    sender = BucketSender(InProcessTransport(record), 1024, dtype=torch.bfloat16, buffer=buffer)
    for stream in (shifted, odd, shifted, odd, mixed, odd):
        got.clear(), paddings.clear(), buckets.clear()
        sender.send(stream)
        assert receiver.finish() == len(stream)
        assert len(buckets) > 1 or stream is mixed
        assert all(p.numel() == 0 or not p.any() for p in paddings) and any(p.numel() for p in paddings)
        for (name, ref), (got_name, out) in zip(stream, got):
            want = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
            assert got_name == name and out.dtype == want.dtype and torch.equal(out, want), name


def test_unpack_reads_a_buffer_that_starts_inside_its_storage_and_refuses_partial_buckets():
    """Views of a bucket whose buffer is a slice of a larger storage (an attached or mapped buffer) read the
    bucket's bytes, for every dtype and a 0-d and an empty tensor; a tensor past the buffer's end or off a
    256-byte row is refused by name."""
    import dataclasses

    g = torch.Generator().manual_seed(7)
    weights = [
        ("w", torch.randn(3, 5, 7, generator=g)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(9, dtype=torch.int16)),
        ("h", torch.randn(11, generator=g).half()),
    ]
    storage = torch.full((4096 + 512,), 0xAB, dtype=torch.uint8)
    sent = []
    BucketSender(InProcessTransport(sent.append), 4096, buffer=storage[512:]).send(weights)
    (bucket,) = sent
    assert bucket.buffer.storage_offset() == 512
    got = list(unpack_bucket(bucket, clone=True))
    assert [n for n, _ in got] == [n for n, _ in weights]
    for (name, ref), (_, out) in zip(weights, got):
        assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref), name
    partial = Bucket(bucket.buffer[:500], bucket.metas, 0, True)
    with pytest.raises(WeightSyncError, match="'scalar' at bytes 512..520 is not inside the buffer's 500"):
        list(unpack_bucket(partial))
    moved = [dataclasses.replace(m, offset=m.offset + 8) if m.name == "ids" else m for m in bucket.metas]
    with pytest.raises(WeightSyncError, match="'ids' at bytes"):
        list(unpack_bucket(Bucket(bucket.buffer, moved, 0, True), verify=False))


@pytest.mark.parametrize("limit", [1, 600, 1 << 30])
def test_copy_groups_hold_at_most_their_bytes_of_the_stream(limit):
    """The sender keeps a yielded tensor alive only until its group is copied: at most ``copy_group_bytes``
    (plus the tensor that crossed it) of freshly made tensors, the extra memory of a gathering stream."""
    import weakref

    g = torch.Generator().manual_seed(6)
    alive, most = [], 0
    values = [torch.randn(50, generator=g) for _ in range(12)]  # 200 bytes each as fp32

    def stream():
        nonlocal most
        for i, v in enumerate(values):
            fresh = v.clone()
            alive.append(weakref.ref(fresh))
            yield f"w{i}", fresh
            del fresh
            most = max(most, sum(r() is not None for r in alive))

    got = []
    receiver = BucketReceiver(lambda ts: got.extend(t.clone() for _, t in ts))
    BucketSender(InProcessTransport(receiver), 4096, copy_group_bytes=limit).send(stream())
    assert receiver.finish() == 12 and all(torch.equal(a, b) for a, b in zip(got, values))
    # after a yield: the group not yet copied (under the limit), or at least the loop's last tensor
    assert most == min(12, max(1, (limit - 1) // 200))
    with pytest.raises(ValueError, match="copy_group_bytes must be positive"):
        BucketSender(InProcessTransport(receiver), 4096, copy_group_bytes=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_copies_on_cuda_cast_like_copy():
    """torch._foreach_copy_'s CUDA kernel (the fast path: one source dtype, contiguous) casts as ``copy_``
    does, in groups split by source dtype, by a non-contiguous source and by the group limit, from the GPU and
    the CPU."""
    g = torch.Generator().manual_seed(8)
    weights = [(f"f{i}", torch.randn(1000 + 7 * i, 33, generator=g)) for i in range(5)]
    weights += [("ids", torch.arange(77)), ("h", torch.randn(5, 9, generator=g).half())]
    weights += [("t", torch.randn(40, 30, generator=g).t()), ("f_last", torch.randn(3, generator=g))]
    for source_device, limit in (("cuda", 1 << 30), ("cuda", 300_000), ("cpu", 1 << 30)):
        got: list[tuple[str, torch.Tensor]] = []
        receiver = BucketReceiver(lambda ts, got=got: got.extend((n, t.cpu()) for n, t in ts))
        stream = [(n, t.to(source_device)) for n, t in weights]
        BucketSender(
            InProcessTransport(receiver), 1 << 20, "cuda", torch.bfloat16, copy_group_bytes=limit
        ).send(stream)
        assert receiver.finish() == len(weights)
        for (name, ref), (_, out) in zip(weights, got):
            want = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
            assert out.dtype == want.dtype and torch.equal(out, want), (name, source_device, limit)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checksums_on_cuda_equal_the_cpu_ones():
    """cuBLASLt's int8 GEMM gives the CPU's row hashes: a bucket of many spans (one of fewer than 17 rows, one
    across scan chunks) and single tensors, checksummed on each device."""
    g = torch.Generator().manual_seed(4)
    buffer = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, generator=g)
    spans, offset = [], 0
    for n in [3, 256, 4000, 1 << 20, 77, 1 << 21]:
        buffer[offset + n : padded(offset + n)] = 0
        spans.append((offset, n))
        offset = padded(offset + n)
    on_gpu = buffer.cuda()
    assert bucket_checksums(on_gpu, spans, 1 << 12) == bucket_checksums(buffer, spans, 1 << 12)
    tensors = [torch.randn(5, 3, generator=g), torch.randn(1 << 20, generator=g).to(torch.bfloat16)]
    assert [tensor_checksum(t.cuda()) for t in tensors] == [tensor_checksum(t) for t in tensors]


def test_cpu_row_hashes_equal_the_int8_matmul() -> None:
    """The CPU path (float32 products) gives exactly the int8 matrix multiply's hashes, extremes included."""
    from posttrain.core.checksum import _tables, row_hashes

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-128, 128, (4096, 256), generator=g, dtype=torch.int8)
    rows[0] = -128
    rows[1] = 127
    w, c = _tables(rows.device)
    assert torch.equal(row_hashes(rows), (torch._int_mm(rows, w).to(torch.int64) * c).sum(1))
