r"""Weight-sync bandwidth: the FSDP engine -> a receiving process, over CUDA IPC (GPU) or shared memory (CPU).

What one run measures, for a Qwen2.5-1.5B-shaped model in bf16 (3.09 GB; ``--tiny``: a small model on CPU):

- ``gather``: iterating the engine's ``get_per_tensor_param`` stream (FSDP2 all-gather of each tensor, cast to
  bf16), nothing else.
- ``pack``: the trainer side of a sync minus the gather: copying each tensor into the bucket and checksumming
  it (engine-core's :class:`BucketSender`), plus the per-bucket hand-off.
- ``transfer``: the receiver's read of each bucket out of the trainer's buffer into its own memory (the CUDA
  IPC mapping, or the shared-memory segment), timed in the receiving process.
- ``verify``: the receiver's checksum of every tensor; ``load``: copying the tensors into the receiving
  model's parameters (an HF model; vLLM's layerwise reload adds its own processing on top of this).
- ``copy``: a device-to-device copy of the same number of bytes in the sending process, in the same run
  (GPU0 -> GPU1 with ``--gpus 2``): the roofline the transfer is compared with.

The receiving process is the code path of the vLLM worker extension (:class:`BucketOpener` +
:class:`BucketReceiver`); vLLM itself is not needed. Run (1 or 2 GPUs, or CPU)::

    PYTHONPATH=packages/engine-core/src:packages/ckpt/src:packages/engine-fsdp/src:packages/rollout-vllm/src \
        python bench/weight_sync.py [--gpus 2] [--bucket-mb 512] [--reps 3] [--json out.json]
    ... python bench/weight_sync.py --tiny          # CPU, shared memory, a small model
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.core import testing

QWEN25_15B = dict(testing.QWEN25_15B, max_position_embeddings=32768, rope_theta=1_000_000.0)
"""The Qwen2.5 shape of ``posttrain.core.testing`` with the fields a model built from it needs."""
TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def receiver_main(conn: Any, model_dir: str, device: str, dtype: torch.dtype) -> None:
    """Receive buckets, time transfer / verify / load, reply per bucket and with totals at the end of a
    sync."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.core.weight_sync import Bucket, BucketReceiver
    from posttrain.rollout_vllm.transport import BucketOpener

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    params = dict(model.state_dict(keep_vars=True))
    opener, times = BucketOpener(), {"transfer": 0.0, "verify": 0.0, "load": 0.0}
    local = torch.empty(0, dtype=torch.uint8, device=dev)

    def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        for name, tensor in tensors:
            params[name].data.copy_(tensor)
        sync(dev)
        times["load"] += time.perf_counter() - start

    receiver = BucketReceiver(load)
    conn.send("ready")
    while (payload := conn.recv()) is not None:
        if payload == "finish":
            conn.send({**times, "num_tensors": receiver.finish()})
            times.update(transfer=0.0, verify=0.0, load=0.0)
            continue
        bucket = opener.open(payload)
        used = max(((m.offset + m.nbytes + 3) // 4 * 4 for m in bucket.metas), default=0)
        start = time.perf_counter()
        if local.numel() < used:
            local = torch.empty(bucket.buffer.numel(), dtype=torch.uint8, device=dev)
        local[:used].copy_(bucket.buffer[:used])  # the transfer: read the trainer's bytes into our memory
        sync(dev)
        times["transfer"] += time.perf_counter() - start
        before = times["load"]
        start = time.perf_counter()
        receiver(Bucket(local, bucket.metas, bucket.index, bucket.is_last))
        times["verify"] += time.perf_counter() - start - (times["load"] - before)
        conn.send("ok")
    opener.close()


def build_engine(model_dir: str, device: torch.device) -> Any:
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.fsdp.config import FSDPEngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    for key, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    engine = FSDPLanguageModelEngine(
        ModelConfig(path=model_dir),
        FSDPEngineConfig(dtype="bfloat16", forward_only=True, max_token_len_per_gpu=4096),
        OptimizerConfig(),
        CheckpointConfig(),
    )
    engine.initialize()
    return engine


def time_gather(engine: Any, dtype: torch.dtype, device: torch.device) -> tuple[float, int]:
    start, nbytes = time.perf_counter(), 0
    stream, _ = engine.get_per_tensor_param(dtype=dtype)
    for _, tensor in stream:
        nbytes += tensor.numel() * tensor.element_size()
    sync(device)
    return time.perf_counter() - start, nbytes


def time_copy(nbytes: int, src_dev: torch.device, dst_dev: torch.device, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    dst.copy_(src)
    sync(src_dev), sync(dst_dev)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        sync(src_dev), sync(dst_dev)
        best = min(best, time.perf_counter() - start)
    return best


def one_sync(
    engine: Any, transport: Any, conn: Any, bucket_bytes: int, dtype: torch.dtype
) -> dict[str, float]:
    from posttrain.core.weight_sync import BucketSender

    start = time.perf_counter()
    stream, _ = engine.get_per_tensor_param(dtype=dtype)
    report = BucketSender(transport, bucket_bytes, dtype=dtype, buffer=transport.buffer).send(stream)
    conn.send("finish")
    totals = conn.recv()
    total = time.perf_counter() - start
    return {"total": total, "num_bytes": report.num_bytes, "num_buckets": report.num_buckets, **totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small model on CPU over shared memory")
    parser.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="2: receiver on the second GPU")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    from transformers import Qwen2Config

    from posttrain.rollout_vllm.transport import RpcBucketTransport

    cuda = not args.tiny
    if cuda and torch.cuda.device_count() < args.gpus:
        raise ValueError(
            f"--gpus {args.gpus} needs {args.gpus} visible GPUs, found {torch.cuda.device_count()}; "
            "use --tiny on a CPU machine"
        )
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    recv_device = torch.device("cuda", args.gpus - 1) if cuda else device
    dtype = torch.bfloat16
    model_dir = tempfile.mkdtemp(prefix="bench-weight-sync-")
    Qwen2Config(**(TINY if args.tiny else QWEN25_15B)).save_pretrained(model_dir)  # config only: seeded init
    engine = build_engine(model_dir, device)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, model_dir, str(recv_device), dtype))
    proc.start()
    assert parent.recv() == "ready"

    def send(payload: bytes) -> None:
        parent.send(payload)
        parent.recv()

    bucket_bytes = args.bucket_mb << 20
    transport = RpcBucketTransport("cuda_ipc" if cuda else "shm", bucket_bytes, device, send)
    results: list[dict[str, float]] = []
    try:
        one_sync(engine, transport, parent, bucket_bytes, dtype)  # warm-up: IPC handle opening, allocations
        for _ in range(args.reps):
            gather_s, nbytes = time_gather(engine, dtype, device)
            run = one_sync(engine, transport, parent, bucket_bytes, dtype)
            run["gather"] = gather_s
            run["copy"] = time_copy(nbytes, device, recv_device, 3)
            results.append(run)
    finally:
        parent.send(None)
        proc.join(timeout=120)
        transport.close()
    report(results, args, device, recv_device)


def report(
    results: list[dict[str, float]], args: argparse.Namespace, device: torch.device, recv_device: torch.device
) -> None:
    best = min(results, key=lambda r: r["total"])
    gb = best["num_bytes"] / 1e9
    best["pack"] = best["total"] - best["gather"] - best["transfer"] - best["verify"] - best["load"]
    rates = {k: gb / best[k] for k in ("transfer", "copy", "total") if best[k] > 0}
    summary = {
        "model": "tiny" if args.tiny else "qwen2.5-1.5b",
        "bytes": best["num_bytes"],
        "buckets": best["num_buckets"],
        "bucket_mb": args.bucket_mb,
        "sender": str(device),
        "receiver": str(recv_device),
        **{
            f"{k}_ms": round(best[k] * 1e3, 3)
            for k in ("gather", "pack", "transfer", "verify", "load", "total", "copy")
        },
        **{f"{k}_GBps": round(v, 2) for k, v in rates.items()},
        "transfer_over_copy": round(best["copy"] / best["transfer"], 3) if best["transfer"] > 0 else None,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
