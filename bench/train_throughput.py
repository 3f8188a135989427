"""Training throughput of the FSDP engine against a hand-written HF + FSDP2 loop, on one or two GPUs.

What it measures, in one launch per GPU count (all numbers per step, after warm-up steps):

- ``matmul_ceiling``: bf16 (fp32 with ``--tiny``) dense matmul TFLOP/s on this device, measured first.
- ``engine``: ``FSDPLanguageModelEngine`` (FSDP2, bf16 params / fp32 reductions, packed sequences, chunked
  log-prob head) on micro-batches of sequences whose lengths are drawn uniformly from 64..4096, packed up to
  ``--tokens`` tokens per micro-batch and rank, with a token-mean ``-log_prob`` loss.
- ``baseline_fixed``: the loop of shared/reference/platform.md: HF ``Qwen2ForCausalLM``
  (sdpa) + ``fully_shard`` per decoder layer and root + ``MixedPrecisionPolicy(bf16, fp32)`` + fused AdamW,
  padded 8 x 2048.
- ``baseline_varied``: the same loop on the varied lengths, 8 randomly drawn sequences per step padded to the
  longest (what a plain HF loop does).

Reported per run: real-token tokens/s (padding excluded), MFU = model FLOPs / time / (ceiling x GPUs) with
FLOPs = 6 N tokens + 12 layers hidden sum(len^2) (real tokens only; recomputation not counted), and peak
memory.
With ``--gpus 1,2`` both launches run and the 2-GPU scaling efficiency is printed.

Model: Qwen2.5-1.5B shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, FFN 8960, vocab 151936, tied
embeddings), random init. ``--tiny`` swaps in a 2-layer model, short sequences, fp32 and CPU/gloo when no GPU
is present, so the script can be checked anywhere:

    uv run python bench/train_throughput.py --tiny --gpus 1,2          # CPU smoke run
    python bench/train_throughput.py --gpus 1,2 --out results.json       # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FULL = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--gpus", default="1", help="GPU counts to run, e.g. 1, 2 or 1,2 (processes with --tiny on CPU)"
    )
    p.add_argument("--tiny", action="store_true", help="2-layer model, short sequences, fp32: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 3 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch and rank (default 16384)")
    p.add_argument("--grad-ckpt", action="store_true", help="engine: recompute decoder layers in backward")
    p.add_argument(
        "--no-compile", action="store_true", help="engine: do not torch.compile the log-prob chunk"
    )
    p.add_argument("--compile-layers", action="store_true", help="engine: torch.compile each decoder layer")
    p.add_argument("--entropy", action="store_true", help="engine: also compute the entropy")
    p.add_argument(
        "--profile", action="store_true", help="engine: print the top CPU and GPU ops of one extra step"
    )
    p.add_argument(
        "--trace",
        default=None,
        help="engine, with --profile: also write rank 0's chrome trace here (.json.gz)",
    )
    p.add_argument("--chunk", type=int, default=4096, help="engine: tokens per log-prob head chunk")
    p.add_argument(
        "--reshard-after-forward",
        choices=("auto", "true", "false"),
        default="auto",
        help="engine: FSDP2 reshard_after_forward (auto = false on one GPU, true otherwise)",
    )
    p.add_argument("--skip-baseline", action="store_true", help="run the engine only")
    p.add_argument(
        "--baseline-rows",
        type=int,
        default=4,
        choices=(1, 2, 4, 8),
        help="varied baseline: rows per backward (the 8 rows share one padded width; 8 may not fit)",
    )
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument(
        "--result-file", default=None, help=argparse.SUPPRESS
    )  # set by the launcher for each worker
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- measurements
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling(device: torch.device, dtype: torch.dtype, tiny: bool) -> float:
    """Best dense matmul FLOP/s over a few sizes."""
    best = 0.0
    for n in (256, 512) if tiny else (4096, 8192):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        sync(device)
        reps = 5 if tiny else 50
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


def model_flops(num_params: int, cfg: dict[str, Any], lengths: list[int]) -> float:
    """6 N tokens + 12 layers hidden sum(len^2): the platform.md formula on real tokens."""
    return 6 * num_params * sum(lengths) + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * sum(
        n * n for n in lengths
    )


def draw_lengths(gen: torch.Generator, lo: int, hi: int, budget: int) -> list[int]:
    """Uniform lengths in [lo, hi] until the next one would overflow ``budget`` tokens."""
    out: list[int] = []
    while True:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        if sum(out) + n > budget:
            return out or [budget]
        out.append(n)


def timed_loop(
    step_fn: Any, batches: list[Any], warmup: int, device: torch.device
) -> tuple[float, list[Any]]:
    """Run ``warmup`` untimed steps, then every batch once; seconds per timed step."""
    for b in batches[:warmup]:
        step_fn(b)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step_fn(b)
    sync(device)
    return (time.perf_counter() - t0) / max(1, len(batches) - warmup), batches[warmup:]


KERNEL_KINDS = (
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attn|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|tensorop"),
    ("optimizer", r"adam|multi_tensor|l2norm"),
    ("softmax_reduce", r"softmax|logsumexp|reduce_kernel"),
    ("copy", r"memcpy|memset|copy|catarray"),
    ("triton", r"^triton"),
)
"""Device-time buckets by kernel name (first match, lower-cased); the rest is ``other`` (elementwise,
norms)."""


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, low)), "other")


def print_profile(step: Any, device: torch.device, trace: str | None = None) -> dict[str, Any]:
    """Run ``step`` once under the torch profiler; rank 0 prints the ops with the most CPU and device time
    (and writes the chrome trace to ``trace``). Returns rank 0's kernel time in ms by :func:`kernel_kind` and
    its ten longest kernels (empty without CUDA), for side-by-side tables of runs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    if dist.get_rank() != 0:
        return {}
    if trace:
        prof.export_chrome_trace(trace)
    keys = ["self_cpu_time_total"] + (["self_cuda_time_total"] if device.type == "cuda" else [])
    for key in keys:
        table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
        print(table, flush=True)
    # CPU ops hold no kernels; a record_function range on the GPU timeline (Megatron-FSDP's
    # "CustomFSDP.forward", the optimizer's "Optimizer.step#...") spans kernels counted already
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]
    return {
        "kernel_ms": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [[e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count] for e in top],
    }


def summarize(
    name: str,
    sec: float,
    timed: list[list[int]],
    computed_tokens: int,
    num_params: int,
    cfg: dict[str, Any],
    ceiling: float,
    device: torch.device,
) -> dict[str, Any]:
    """Throughput over all ranks (lengths gathered), MFU against the ceiling times the GPU count.

    ``timed`` holds each timed step's real sequence lengths on this rank; ``computed_tokens`` the tokens this
    rank pushed through the model in those steps, padding included."""
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, ([n for lens in timed for n in lens], computed_tokens))
    lengths = [n for lens, _ in gathered for n in lens]
    computed = sum(c for _, c in gathered)
    steps, real = len(timed), sum(lengths)
    flops = model_flops(num_params, cfg, lengths) / steps / sec
    peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    return {
        "run": name,
        "gpus": world,
        "sec_per_step": round(sec, 4),
        "real_tokens_per_s": round(real / steps / sec, 1),
        "padding_fraction": round(1 - real / computed, 3),
        "tflops_per_gpu": round(flops / world / 1e12, 3),
        "mfu": round(flops / (ceiling * world), 4),
        "peak_mem_gib": peak,
    }


# ---------------------------------------------------------------------------------------------- the two loops
def run_engine(
    args: argparse.Namespace, model_dir: str, cfg: dict[str, Any], device: torch.device, ceiling: float
) -> dict[str, Any]:
    from posttrain.core.batch import PackedBatch
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.fsdp.config import FSDPEngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    reshard = {"auto": dist.get_world_size() > 1, "true": True, "false": False}[args.reshard_after_forward]
    engine_cfg = FSDPEngineConfig(
        strategy="fsdp2",
        dtype="float32" if args.tiny else "bfloat16",
        max_token_len_per_gpu=args.tokens,
        reshard_after_forward=reshard,
        use_torch_compile=not args.no_compile,
        compile_layers=args.compile_layers,
        entropy_from_logits_chunk_size=args.chunk,
    )
    eng = FSDPLanguageModelEngine(
        ModelConfig(path=model_dir, enable_gradient_checkpointing=args.grad_ckpt),
        engine_cfg,
        OptimizerConfig(lr=1e-5),
        CheckpointConfig(),
    )
    eng.initialize()
    num_params = sum(p.numel() for p in eng.module.parameters())

    def loss_fn(out, mb, ctx):
        loss = -(out["log_probs"] * mb.loss_mask).sum() / ctx.global_num_tokens * ctx.dp_size
        return loss, {}

    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    lo, hi = (8, 64) if args.tiny else (64, 4096)
    lengths = [draw_lengths(gen, lo, hi, args.tokens) for _ in range(args.warmup + args.steps)]
    vocab = cfg["vocab_size"]
    batches = [
        PackedBatch.from_sequences(
            [torch.randint(0, vocab, (n,), generator=gen) for n in lens],
            meta={"calculate_entropy": args.entropy},
        )
        for lens in lengths
    ]
    with eng.train_mode():
        sec, timed = timed_loop(lambda b: eng.train_batch(b, loss_fn), batches, args.warmup, device)
        profiled = {}
        if args.profile:
            profiled = print_profile(lambda: eng.train_batch(batches[-1], loss_fn), device, args.trace)
    timed_lengths = [b.seqlens for b in timed]
    result = summarize(
        "engine_packed_varied" + ("_compiled" if args.compile_layers else ""),
        sec,
        timed_lengths,
        sum(map(sum, timed_lengths)),
        num_params,
        cfg,
        ceiling,
        device,
    )
    return result | ({"profile": profiled} if profiled else {})


def run_baseline(
    args: argparse.Namespace,
    model_dir: str,
    cfg: dict[str, Any],
    device: torch.device,
    ceiling: float,
    varied: bool,
) -> dict[str, Any]:
    """platform.md's loop: HF sdpa model, fully_shard per layer + root, bf16/fp32 mixed precision, fused
    AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir), attn_implementation="sdpa", dtype=torch.float32
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    compute = torch.float32 if args.tiny else torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)
    num_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(2000 + dist.get_rank())
    lo, hi, fixed = (8, 64, 64) if args.tiny else (64, 4096, 2048)
    steps = [
        [fixed] * 8 if not varied else [int(torch.randint(lo, hi + 1, (1,), generator=gen)) for _ in range(8)]
        for _ in range(args.warmup + args.steps)
    ]
    vocab = cfg["vocab_size"]

    def make(lens: list[int]) -> dict[str, torch.Tensor]:
        width = max(lens)
        ids = torch.randint(0, vocab, (len(lens), width), generator=gen)
        mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).long()
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    batches = [make(lens) for lens in steps]

    rows = args.baseline_rows if varied else 8

    def step(b: dict[str, torch.Tensor]) -> None:
        for start in range(0, 8, rows):  # gradient accumulation over row groups of the same padded width
            model(**{k: v[start : start + rows] for k, v in b.items()}).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model.train()
    sec, _ = timed_loop(step, batches, args.warmup, device)
    timed = steps[args.warmup :]
    computed = sum(8 * max(lens) for lens in timed)
    name = "baseline_padded_varied" if varied else "baseline_padded_8x2048"
    result = summarize(name, sec, timed, computed, num_params, cfg, ceiling, device)
    return result


# ---------------------------------------------------------------------------------------------- launch
def worker(args: argparse.Namespace) -> None:
    from transformers import Qwen2Config

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = TINY if args.tiny else FULL
    model_dir = tempfile.mkdtemp(prefix="bench_model_") if dist.get_rank() == 0 else None
    box = [model_dir]
    dist.broadcast_object_list(box)
    if dist.get_rank() == 0:
        Qwen2Config(**cfg).save_pretrained(box[0])
    dist.barrier()
    ceiling = matmul_ceiling(device, torch.float32 if args.tiny else torch.bfloat16, args.tiny)
    results: list[dict[str, Any]] = []

    def record(result: dict[str, Any]) -> None:  # written after every run, so a later failure keeps the rest
        results.append(result)
        if dist.get_rank() == 0:
            Path(args.result_file).write_text(json.dumps(results))
        if cuda:
            torch.cuda.empty_cache()

    record(
        {"run": "matmul_ceiling", "gpus": dist.get_world_size(), "tflops_per_gpu": round(ceiling / 1e12, 3)}
    )
    runs = [("engine_packed_varied", lambda: run_engine(args, box[0], cfg, device, ceiling))]
    if not args.skip_baseline:
        runs += [
            (name, lambda varied=varied: run_baseline(args, box[0], cfg, device, ceiling, varied))
            for name, varied in (("baseline_padded_8x2048", False), ("baseline_padded_varied", True))
        ]
    for name, run in runs:
        try:
            record(run())
        except torch.cuda.OutOfMemoryError as exc:  # reported as a result: the other runs still count
            record({"run": name, "gpus": dist.get_world_size(), "error": f"out of memory: {str(exc)[:200]}"})
    dist.destroy_process_group()


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Run one torchrun launch per GPU count, then print the table and the scaling efficiency."""
    counts = [int(c) for c in args.gpus.split(",")]
    if not args.tiny and torch.cuda.device_count() < max(counts):
        raise SystemExit(
            f"--gpus {args.gpus} needs {max(counts)} GPUs, this machine has {torch.cuda.device_count()}"
        )
    results: list[dict[str, Any]] = []
    for n in counts:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result_file = f.name
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(n),
            __file__,
            *argv,
            "--result-file",
            result_file,
        ]
        proc = subprocess.run(
            cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        )
        got = json.loads(Path(result_file).read_text() or "[]")
        results += got or [{"run": "launch_failed", "gpus": n, "returncode": proc.returncode}]
        if proc.returncode:
            results.append({"run": "launch_failed", "gpus": n, "returncode": proc.returncode})
    engine = {r["gpus"]: r for r in results if r["run"] == "engine_packed_varied" and "error" not in r}
    if 1 in engine and 2 in engine:
        eff = engine[2]["real_tokens_per_s"] / (2 * engine[1]["real_tokens_per_s"])
        results.append({"run": "scaling_efficiency_2gpu", "gpus": 2, "value": round(eff, 3)})
    for r in results:
        print(json.dumps(r))
    base = {(r["gpus"], r["run"]): r for r in results}
    for n in counts:
        if n in engine and "error" not in base.get((n, "baseline_padded_varied"), {"error": 1}):
            speedup = (
                engine[n]["real_tokens_per_s"] / base[(n, "baseline_padded_varied")]["real_tokens_per_s"]
            )
            print(json.dumps({"run": "engine_vs_baseline_varied", "gpus": n, "speedup": round(speedup, 2)}))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def use_repo_sources() -> None:
    """Import posttrain from this checkout (the GPU machine has torch and transformers but no install)."""
    repo = Path(__file__).resolve().parents[1]
    for src in ("packages/engine-core/src", "packages/engine-fsdp/src"):
        sys.path.insert(0, str(repo / src))


def main(argv: list[str] | None = None) -> None:
    use_repo_sources()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.tokens = args.tokens or (256 if args.tiny else 16384)
    if args.result_file:
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
