"""The host cost of packing a weight sync: engine-core's :class:`BucketSender` against the per-tensor pack it
replaced (``--baseline`` arm, in the same run), on the 338-tensor layout of Qwen2.5-1.5B.

The stream is the FSDP engine's on one rank: fp32 tensors as stored (views of the parameters, nothing
gathered), cast to bf16 in the pack. Each sync packs every tensor into checksummed buckets and hands each
bucket to a receiver that verifies every checksum and loads nothing, as ``bench/vllm_sync.py``'s ``pack``
does. Arms:

- ``new``: :class:`BucketSender` as the rollouts use it (one sender kept across syncs): the tensors copied in
  groups with ``torch._foreach_copy_``, each bucket's padding zeroed by one cached indexed fill, one
  ``as_strided`` per tensor on the receiver's side, the checksums' scan index cached per layout;
- ``baseline``: the sender and receiver before, in the same run: one ``copy_`` into a cached buffer view per
  tensor and one ``zero_`` of its padding (when its bytes are not a multiple of 256); a slice and two views
  per tensor on the receiver's side; the checksums' scan index built for every bucket on both sides (the cache
  emptied before each).

With ``--fsdp`` the stream is the FSDP2 engine's ``get_per_tensor_param`` on one rank (a Qwen2.5-1.5B-shaped
model scaled by ``--scale``, saved and loaded as the trainer does), and the run also times the stream alone
(``stream``) and the per-tensor step that takes one rank's full tensor out of its DTensor: ``local_tensor``
(the DTensor's local tensor, detached, as the stream does now) against ``to_local`` (``to_local().detach()``
under ``torch.no_grad()``, as it did before), over the same 338 DTensors.

Printed per arm: the median sync time over ``--reps``, the same per tensor, and the ATen ops one sync
dispatches (counted with a ``TorchDispatchMode``; on a GPU each is a kernel launch or a view: the host work
this removes, whatever the device). ``--scale N`` divides every dimension by N (bucket bytes by N**2): the
tensors keep their count, names, dtypes and order but get small, so a CPU run times the per-tensor host work
rather than memory bandwidth; ``--scale 1 --device cuda`` is the full 3.09 GB sync on a GPU. Run::

    OMP_NUM_THREADS=1 uv run python bench/sync_pack.py [--scale 16] [--reps 20] [--device cpu] [--fsdp]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.core.checksum import _SPAN_PLANS, ROW, padded
from posttrain.core.rollout import SyncReport
from posttrain.core.weight_sync import BucketReceiver, BucketSender, InProcessTransport

QWEN25_15B = dict(vocab=151936, hidden=1536, intermediate=8960, layers=28, kv=256)
BUCKET_BYTES = 2 << 30  # the rollout's default update_weights_bucket_megabytes (2048)


def layout(scale: int) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of Qwen2.5-1.5B's synced tensors in the engine's order (tied lm_head left out)."""
    v, h, i, kv = (QWEN25_15B[k] // scale for k in ("vocab", "hidden", "intermediate", "kv"))
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(QWEN25_15B["layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return out + [("model.norm.weight", (h,))]


class PerTensorSender(BucketSender):
    """The baseline: the sender as it was, one ``copy_`` and (for a tensor whose bytes are not a multiple of
    :data:`ROW`) one ``zero_`` of its padding per tensor, dispatched from Python."""

    def send(self, weights: Any) -> SyncReport:
        report, pending, offset = SyncReport(), [], 0
        for name, tensor in weights:
            dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * dtype.itemsize
            if offset + padded(nbytes) > self.bucket_bytes:
                self._send_bucket(pending, report)
                pending, offset = [], 0
            self._target(offset, dtype, tuple(tensor.shape)).copy_(tensor, non_blocking=self.buffer.is_cuda)
            if nbytes % ROW:
                self.buffer[offset + nbytes : offset + padded(nbytes)].zero_()
            pending.append((name, tuple(tensor.shape), dtype, offset, nbytes))
            offset += padded(nbytes)
            report.num_tensors += 1
        self._send_bucket(pending, report, is_last=True)
        return report

    def _send_bucket(self, pending: list[tuple], report: SyncReport, is_last: bool = False) -> None:
        from posttrain.core.weight_sync import Bucket, TensorMeta, bucket_checksums

        _SPAN_PLANS.clear()  # the checksum's scan index built per bucket, as it was
        sums = bucket_checksums(self.buffer, [(off, nbytes) for _, _, _, off, nbytes in pending])
        metas = [TensorMeta(*entry, checksum) for entry, checksum in zip(pending, sums)]
        self.transport.send(Bucket(self.buffer, metas, report.num_buckets, is_last))
        report.num_buckets += 1


class PerTensorReceiver(BucketReceiver):
    """The baseline's receiver: the bucket's views as they were built, a slice and two views per tensor."""

    def __call__(self, bucket: Any) -> None:
        from posttrain.core.checksum import bucket_checksums

        views = [bucket.buffer[m.offset : m.offset + m.nbytes] for m in bucket.metas]
        _SPAN_PLANS.clear()
        sums = bucket_checksums(bucket.buffer, [(m.offset, m.nbytes) for m in bucket.metas])
        if sums != [m.checksum for m in bucket.metas]:
            raise RuntimeError(f"bucket {bucket.index}: a checksum does not match")
        self.load([(m.name, v.view(m.dtype).view(m.shape)) for m, v in zip(bucket.metas, views)])
        self.num_tensors += len(views)
        self.expected_index += 1
        self.complete = bucket.is_last


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def fsdp_engine(scale: int) -> Any:
    """The FSDP2 engine (one rank) on a random-init Qwen2.5-1.5B-shaped model with every
    dimension / ``scale``."""
    from vllm_sync import build_engine, save_model  # beside this file
    from weight_sync import QWEN25_15B as SHAPE

    keys = ("vocab_size", "hidden_size", "intermediate_size")
    return build_engine(save_model({**SHAPE, **{k: SHAPE[k] // scale for k in keys}}))


def median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def time_stream_parts(engine: Any, reps: int) -> dict[str, Any]:
    """The engine's stream alone, and the two ways of taking a full tensor out of a one-rank DTensor."""
    from torch.distributed.tensor import DTensor

    shards = [t for t in engine.module.state_dict(keep_vars=True).values() if isinstance(t, DTensor)]

    def to_local() -> None:
        for t in shards:
            with torch.no_grad():
                t.to_local().detach()

    def local_tensor() -> None:
        for t in shards:
            t._local_tensor.detach()

    out = {
        "dtensors": len(shards),
        "stream_ms": median_ms(lambda: list(engine.get_per_tensor_param()[0]), reps),
    }
    for name, fn in (("to_local", to_local), ("local_tensor", local_tensor)):
        out[f"{name}_us_per_tensor"] = round(median_ms(fn, reps) * 1e3 / len(shards), 2)
    return out


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(sender: BucketSender, receiver: BucketReceiver, stream: Any, device: torch.device) -> float:
    """One sync; ``stream`` is a list of (name, tensor) or an engine (its stream, as stored)."""
    start = time.perf_counter()
    sender.send(stream if isinstance(stream, list) else stream.get_per_tensor_param()[0])
    receiver.finish()
    sync_device(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=16, help="divide every dimension by this")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fsdp", action="store_true", help="the FSDP2 engine's stream (see above)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    tensors = [(name, torch.randn(shape, generator=gen).to(device)) for name, shape in layout(args.scale)]
    stream: Any = fsdp_engine(args.scale) if args.fsdp else tensors
    if args.fsdp:
        tensors = list(stream.get_per_tensor_param()[0])
        if args.device != str(tensors[0][1].device.type):
            raise ValueError(f"--device {args.device}: the engine's tensors are on {tensors[0][1].device}")
    bucket_bytes = BUCKET_BYTES // args.scale**2
    arms = {}
    for arm, cls, receiver_cls in (
        ("baseline", PerTensorSender, PerTensorReceiver),
        ("new", BucketSender, BucketReceiver),
    ):
        receiver = receiver_cls(lambda tensors: None)
        sender = cls(InProcessTransport(receiver), bucket_bytes, device=device, dtype=torch.bfloat16)
        run_arm(sender, receiver, stream, device)  # warm-up: buffer views, padding index
        arms[arm] = (sender, receiver)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(args.reps):  # the arms in turn, first one then the other, so drift hits both
        for arm in sorted(arms, reverse=rep % 2 == 1):
            sender, receiver = arms[arm]
            times[arm].append(run_arm(sender, receiver, stream, device))
    summary: dict[str, Any] = {
        "device": args.device,
        "scale": args.scale,
        "stream": "fsdp2" if args.fsdp else "tensors",
        "tensors": len(tensors),
        "bucket_bytes": bucket_bytes,
        "bf16_bytes": sum(t.numel() * 2 for _, t in tensors),
    }
    if args.fsdp:
        summary.update(time_stream_parts(stream, args.reps))
    for arm, (sender, receiver) in arms.items():
        with OpCounter() as counter:
            run_arm(sender, receiver, stream, device)
        median = statistics.median(times[arm])
        summary[arm] = {
            "ms_median": round(median * 1e3, 3),
            "ms_min": round(min(times[arm]) * 1e3, 3),
            "us_per_tensor": round(median * 1e6 / len(tensors), 2),
            "aten_ops": sum(counter.ops.values()),
            "top_ops": dict(counter.ops.most_common(6)),
        }
    summary["speedup"] = round(summary["baseline"]["ms_median"] / summary["new"]["ms_median"], 2)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
