"""The pair transport moves whole buckets, the zero bytes after an odd-sized last tensor included, so the
receiver's checksums pass: over gloo (both members in one process, one thread each), and over NCCL from one
GPU to another (two processes, with two GPUs)."""

import socket
import threading
import time

import pytest
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


def _nccl_member(rank: int, port: int, out) -> None:
    """Member ``rank`` of an NCCL pair on GPU ``rank``: 0 sends three buckets of the weights, 1 verifies
    them."""
    import pickle

    from posttrain.core.dist_transport import nccl_pair_group

    torch.cuda.set_device(rank)
    store = pair_store(rank, port, timeout_s=60)
    transport = PairBucketTransport(
        pair_group(store, rank, 60), 1 - rank, nccl_pair_group(store, rank, 60), f"cuda:{rank}"
    )
    g = torch.Generator().manual_seed(5)
    weights = [(f"w{i}", torch.randn(300, 7 + i, generator=g)) for i in range(6)]
    if rank == 0:
        BucketSender(transport, 8192, device="cuda:0", dtype=torch.bfloat16).send(
            [(n, t.cuda()) for n, t in weights]
        )
        return
    got = []
    receiver = BucketReceiver(lambda ts: got.extend((n, t.cpu()) for n, t in ts))
    while True:
        bucket = transport.recv()
        assert bucket.buffer.device == torch.device("cuda:1")
        receiver(bucket)
        if bucket.is_last:
            break
    receiver.finish()
    out.put(
        pickle.dumps([(n, torch.equal(t, ref.to(torch.bfloat16))) for (n, t), (_, ref) in zip(got, weights)])
    )


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_buckets_cross_an_nccl_pair_gpu_to_gpu_verified():
    import pickle

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for member 0's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_nccl_member, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    result = pickle.loads(out.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [n for n, _ in result] == [f"w{i}" for i in range(6)] and all(ok for _, ok in result)


def test_a_pair_carries_cpu_buffers_over_gloo_and_cuda_ones_over_nccl_only():
    with pytest.raises(ValueError, match="CUDA buffers over nccl_pair_group"):
        PairBucketTransport(None, 1, data=None, device="cuda:0")
    with pytest.raises(ValueError, match="CPU buffers go over gloo"):
        PairBucketTransport(None, 1, data=object(), device="cpu")


def _shared_pair(read_after_s: float = 0.0):
    """A shared pair in one process (a thread each) over a shared-memory buffer; the receiver waits
    ``read_after_s`` before it verifies each bucket, then releases it. Returns (sender, buffer, results)."""
    from posttrain.core.shared_buffer import shared_buffer

    store0 = pair_store(0, timeout_s=30)
    got, errors, order = [], [], []

    def worker():
        transport = PairBucketTransport(
            pair_group(pair_store(1, store0.port, timeout_s=30), 1, 30), 0, shared=True
        )
        try:
            receiver = BucketReceiver(lambda ts: got.extend((n, t.clone()) for n, t in ts))
            while True:
                bucket = transport.recv()
                time.sleep(read_after_s)  # a slow reader: the sender must not pack the next bucket meanwhile
                receiver(bucket)
                order.append(("released", bucket.index))
                transport.release()
                if bucket.is_last:
                    break
            receiver.finish()
        except Exception as exc:  # surfaced by the main thread
            errors.append(exc)
        finally:
            transport.close()

    thread = threading.Thread(target=worker)
    thread.start()
    sender = PairBucketTransport(pair_group(store0, 0, 30), 1, shared=True)
    return sender, shared_buffer(512, "cpu"), (thread, got, errors, order)


def test_buckets_cross_a_shared_memory_pair_verified_and_wait_for_the_receivers_release():
    g = torch.Generator().manual_seed(3)
    weights = [(f"w{i}", torch.randn(3, 2 * i + 1, generator=g)) for i in range(6)]
    sender, buffer, (thread, got, errors, order) = _shared_pair(read_after_s=0.05)
    try:

        class Recording:
            def send(self, bucket):
                sender.send(bucket)
                order.append(("sent", bucket.index))

        report = BucketSender(Recording(), 512, dtype=torch.bfloat16, buffer=sender.attach(buffer)).send(
            weights
        )
        thread.join(timeout=30)
    finally:
        buffer.close()
    assert not errors, errors  # a bucket overwritten while read would fail its checksums
    assert report.num_buckets > 2 and [n for n, _ in got] == [n for n, _ in weights]
    for (_, ref), (_, out) in zip(weights, got):
        assert torch.equal(out, ref.to(torch.bfloat16))
    # each send returned only after the receiver released that bucket
    assert order == [(e, i) for i in range(report.num_buckets) for e in ("released", "sent")]


def test_a_shared_pair_sends_only_from_its_attached_buffer():
    sender, buffer, (thread, _, _, _) = _shared_pair()
    try:
        with pytest.raises(ValueError, match=r"buffer=transport.attach\(shared_buffer"):
            BucketSender(sender, 512).send([("w", torch.ones(4))])  # packed into a buffer of its own
        sender.attach(buffer)
        BucketSender(sender, 512, buffer=buffer.tensor).send([("w", torch.ones(4))])  # unblocks the worker
        thread.join(timeout=30)
    finally:
        buffer.close()
    with pytest.raises(ValueError, match="over NCCL or through a shared buffer, not both"):
        PairBucketTransport(None, 1, data=object(), shared=True)
