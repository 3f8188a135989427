"""The rollout process's weight push (``trainer.rollout_placement=process``) on one device, transport against
transport, in the same run: a receiving process takes the pushed stream as the rollout worker does
(``posttrain.trainers.rl.remote_worker.ReceivedWeights``: verify every bucket's checksums, copy its tensors
out, release it).

- ``shared``: the trainer packs into a buffer the worker maps (``PairBucketTransport(shared=True)``): a
  shared-memory segment on the CPU, CUDA IPC on a GPU (``--device cuda``, worker on the same GPU);
- ``gloo``: the baseline, the bytes of CPU buckets over the gloo pair (the push of ``e0db9c1``, also for a
  worker on the trainer's GPU: packed into host memory, checksummed there, copied back onto the GPU).

The stream: the Qwen2.5-0.5B shape's 290 tensors (``--shape 1.5b``: 338), fp32, cast to bf16 in the pack as
the trainer's push does. Medians over ``--reps``, the two transports taking turns::

    python bench/pair_push.py [--device cpu|cuda] [--shape 0.5b|1.5b] [--reps 3] [--bucket-mb 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp
from weight_sync import QWEN25_15B

QWEN25_05B = dict(
    QWEN25_15B,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)


def shapes(config: dict) -> list[tuple[str, torch.Size]]:
    """(name, shape) of the HF Qwen2 model's parameters (tied ones once), built on the meta device."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    return [(name, p.shape) for name, p in model.named_parameters()]


def _receiver(port: int, shared: bool, device: str, reps: int) -> None:
    from posttrain.core.dist_transport import PairBucketTransport, pair_group, pair_store
    from posttrain.trainers.rl.remote_worker import ReceivedWeights

    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    group = pair_group(pair_store(1, port, timeout_s=300), 1, 300)
    transport = PairBucketTransport(group, 0, device=device if shared else "cpu", shared=shared)
    for _ in range(reps):
        stream = ReceivedWeights(transport)
        for _, tensor in stream:
            if device.startswith("cuda") and not tensor.is_cuda:
                tensor.to(device)  # the worker's rollout loads onto its GPU
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    transport.close()


def push(weights: list, shared: bool, device: str, reps: int, bucket_bytes: int) -> list[float]:
    """Seconds per push (sender's start to the receiver's release of the last bucket)."""
    from posttrain.core.dist_transport import PairBucketTransport, pair_group, pair_store
    from posttrain.core.shared_buffer import shared_buffer
    from posttrain.core.weight_sync import BucketSender

    store = pair_store(0, timeout_s=300)
    child = mp.get_context("spawn").Process(target=_receiver, args=(store.port, shared, device, reps))
    child.start()
    send_device = device if shared else "cpu"
    transport = PairBucketTransport(pair_group(store, 0, 300), 1, device=send_device, shared=shared)
    buffer = shared_buffer(bucket_bytes, send_device) if shared else None
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sender = BucketSender(
            transport,
            bucket_bytes,
            device=send_device,
            dtype=torch.bfloat16,
            buffer=transport.attach(buffer) if shared else None,
        )
        sender.send(iter(weights))
        times.append(time.perf_counter() - start)
    child.join(timeout=300)
    if buffer is not None:
        buffer.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="0.5b", choices=("0.5b", "1.5b"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cuda:0" if args.device == "cuda" else "cpu"
    shape = QWEN25_05B if args.shape == "0.5b" else QWEN25_15B
    weights = [(name, torch.randn(s, device=device)) for name, s in shapes(shape)]
    nbytes = sum(t.numel() * 2 for _, t in weights)
    runs: dict[str, list[float]] = {"shared": [], "gloo": []}
    for rep in range(args.reps):
        order = ("shared", "gloo") if rep % 2 == 0 else ("gloo", "shared")
        for name in order:  # a fresh receiving process each, warm-up push first
            runs[name] += push(weights, name == "shared", device, 2, args.bucket_mb << 20)[1:]
    summary = {
        "device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu",
        "shape": args.shape,
        "tensors": len(weights),
        "bf16_bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        **{f"{k}_ms_median": round(statistics.median(v) * 1e3, 1) for k, v in runs.items()},
    }
    summary["gloo_over_shared"] = round(summary["gloo_ms_median"] / summary["shared_ms_median"], 2)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
