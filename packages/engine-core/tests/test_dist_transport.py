"""The gloo pair transport moves whole buckets, the zero bytes after an odd-sized last tensor included, so the
receiver's checksums pass (both members in one process, one thread each)."""

import threading

import torch

from posttrain.core.dist_transport import PairBucketTransport, pair_group, pair_store
from posttrain.core.weight_sync import BucketReceiver, BucketSender


def test_odd_sized_tensors_cross_the_gloo_pair_verified():
    g = torch.Generator().manual_seed(3)
    weights = [(f"w{i}", torch.randn(3, 2 * i + 1, generator=g)) for i in range(5)]  # odd bf16 byte counts
    store0 = pair_store(0, timeout_s=30)
    got, errors = [], []

    def worker():
        try:
            transport = PairBucketTransport(pair_group(pair_store(1, store0.port, timeout_s=30), 1, 30), 0)
            transport.buffer = torch.full((1 << 12,), 0xFF, dtype=torch.uint8)  # stale bytes from "earlier"
            receiver = BucketReceiver(lambda ts: got.extend((n, t.clone()) for n, t in ts))
            while True:
                bucket = transport.recv()
                receiver(bucket)
                if bucket.is_last:
                    break
            receiver.finish()
        except Exception as exc:  # surfaced by the main thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    sender = PairBucketTransport(pair_group(store0, 0, 30), 1)
    report = BucketSender(sender, bucket_bytes=256, dtype=torch.bfloat16).send(weights)
    thread.join(timeout=30)
    assert not errors, errors
    assert report.num_buckets > 1 and [n for n, _ in got] == [n for n, _ in weights]
    for (_, ref), (_, out) in zip(weights, got):
        assert torch.equal(out, ref.to(torch.bfloat16))
