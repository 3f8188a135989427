"""Training throughput of the megatron engine next to the FSDP engine, on one and two GPUs, in one command.

One torchrun launch per run and GPU count (``--gpus 1,2``, the default), all on the same data and the same
model directory:

- ``matmul_ceiling``: bf16 (fp32 with ``--tiny``) dense matmul FLOP/s, measured once, in the first launch; the
  later launches reuse it, so every MFU has the same denominator.
- 1 GPU: ``megatron_tp1`` (TP=1), ``megatron_tp1_eager_head`` (TP=1 with the log-prob head's chunk math
  eager, ``use_torch_compile=False``: the compiled head's baseline), ``megatron_tp1_unfused_wgrad`` (TP=1
  with TE's weight gradients added to the fp32 buffer by Megatron's hooks, not accumulated there by the GEMM:
  ``build.fuse_te_wgrad``'s baseline; with TE only), ``megatron_fsdp`` (Megatron-FSDP, DP=1: the documents'
  path), ``megatron_fsdp_wgrad`` (the same with TE's wgrad fusion, which the engine turns on under Megatron
  DDP only: an experiment; with TE only), ``megatron_tp1_fp8`` (TE's FP8, the ``hybrid`` format with
  per-tensor current scaling, ``tensorwise``; skipped without TE), then ``fsdp_engine`` (FSDP2,
  ``compile_layers`` on). Where TE is installed, one more 1-GPU launch runs ``megatron_tp1_no_te``: TP=1 with
  TE hidden (``--hide-te``), Megatron-Core's local layer spec.
- 2 GPUs: ``megatron_tp2_sp`` (TP=2 + sequence parallel), ``megatron_fsdp`` (Megatron-FSDP, DP=2), then
  ``fsdp_engine`` on both GPUs.

The data is ``bench/train_throughput.py``'s: GPU g draws sequences of 64..4096 tokens (uniform) until about
``--tokens`` (16384) tokens per step, from the generator seeded ``1000 + g``. The FSDP engine run is that
script's own ``run_engine``. A Megatron data-parallel rank that spans k GPUs (TP=2: both) trains on the draws
of those k GPUs together, split into micro-batches of at most ``--tokens`` tokens (``use_dynamic_bsz``), so
every run pushes the same tokens per GPU and the 2-GPU runs train on exactly the same sequences. The Megatron
engines run the distributed optimizer; with Transformer Engine installed, its layer spec (``te_layers`` in the
result), else the local layer spec with variable-length attention (the test suite's TE stand-in is registered,
as in the tests).

Reported per run, over timed steps after warm-up: real-token tokens/s, TFLOP/s per GPU and MFU = model FLOPs /
time / (ceiling x GPUs; the bf16 ceiling for the FP8 run too) with FLOPs = 6 N tokens + 12 layers hidden
sum(len^2) (``train_throughput.model_flops``), peak memory, and each Megatron run's MFU over the FSDP engine's
at the same GPU count (``vs_fsdp``). A run that fails is recorded with its error and the others still run.
``--profile``: each run profiles one step more (not timed) and reports its kernel time by kind
(``train_throughput.kernel_kind``: GEMM, attention, optimizer...), printed side by side at the end.
``--tiny``: the 2-layer model, short sequences, fp32, gloo on CPU when no GPU is present, no torch.compile;
Megatron-FSDP needs CUDA and is skipped there.

    uv run python bench/megatron_throughput.py --tiny                      # CPU smoke run, 1 then 2 processes
    python3 bench/megatron_throughput.py --out megatron.json                # 2 x H200, about 5-7 minutes
    python3 bench/megatron_throughput.py --gpus 1 --out megatron.json       # 1 GPU: TE, FP8, no TE, FSDP
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import train_throughput as tt  # bench/ is sys.path[0] when this file runs as a script (or under torchrun)

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "megatron_tp1": {},
    "megatron_tp1_fp8": {"override_transformer_config": {"fp8": "hybrid", "fp8_recipe": "tensorwise"}},
    "megatron_tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "megatron_fsdp": {"use_megatron_fsdp": True},
    "megatron_fsdp_wgrad": {"use_megatron_fsdp": True},
    "megatron_tp1_unfused_wgrad": {"override_transformer_config": {"gradient_accumulation_fusion": False}},
    "megatron_tp1_eager_head": {"use_torch_compile": False},
}
"""Megatron engine config per run."""
RUNS = {
    1: [
        "megatron_tp1",
        "megatron_tp1_eager_head",
        "megatron_tp1_unfused_wgrad",
        "megatron_fsdp",
        "megatron_fsdp_wgrad",
        "megatron_tp1_fp8",
        "fsdp_engine",
    ],
    2: ["megatron_tp2_sp", "megatron_fsdp", "fsdp_engine"],
}
"""Runs of each launch, by GPU (process) count: each is a key of ``LAYOUTS`` or ``fsdp_engine``."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2", help="launches by GPU count: 1, 2 or 1,2 (processes with --tiny)")
    p.add_argument("--runs", default=None, help="comma list of run names to keep (default: all)")
    p.add_argument("--tiny", action="store_true", help="2-layer model, short sequences, fp32: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 6; 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; 1 with --tiny)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per GPU and step (default 16384)")
    p.add_argument(
        "--model-dir", default=None, help="HF model dir, made once (default /tmp/qwen25_15b_shape)"
    )
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument(
        "--profile",
        action="store_true",
        help="every run: print the top ops of one extra step; its kernel time by kind goes into the results",
    )
    p.add_argument(
        "--hide-te",
        action="store_true",
        help="Megatron runs without Transformer Engine even where it is installed (the local layer spec)",
    )
    p.add_argument("--ceiling-flops", type=float, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    known = [*LAYOUTS, "fsdp_engine"]
    assert all(n in known for runs in RUNS.values() for n in runs), f"RUNS names a run outside {known}"
    unknown = [n for n in (args.runs or "").split(",") if n and n not in known]
    if unknown:
        raise SystemExit(f"--runs: unknown run name(s) {unknown}; choose from {known}")
    args.steps = args.steps or (2 if args.tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.tokens = args.tokens or (256 if args.tiny else 16384)
    return args


def use_repo_sources() -> None:
    """Import posttrain and the Megatron test environment from this checkout."""
    for src in (
        "engine-core/src",
        "engine-fsdp/src",
        "engine-megatron/src",
        "ckpt/src",
        "engine-megatron/tests",
    ):
        sys.path.insert(0, str(REPO / "packages" / src))


# --------------------------------------------------------------------------------------------- model and data
def make_model(path: str, cfg: dict[str, Any], device: torch.device, tiny: bool) -> None:
    """A random-init model with weights (Megatron-Bridge loads them), written once and reused by every
    launch."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (Path(path) / "config.json").is_file():
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(**cfg), dtype=torch.float32 if tiny else torch.bfloat16
        )
    model.save_pretrained(path)


def count_params(cfg: dict[str, Any]) -> int:
    """N of the FLOP formula: the HF model's parameters, a tied embedding counted once (what the FSDP run
    counts)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg))
    return sum(p.numel() for p in model.parameters())


def gpu_sequences(args: argparse.Namespace, cfg: dict[str, Any], gpu: int) -> list[list[torch.Tensor]]:
    """Per step, the sequences ``train_throughput.run_engine`` trains on at rank ``gpu`` (same seed, same
    draws)."""
    gen = torch.Generator().manual_seed(1000 + gpu)
    lo, hi = (8, 64) if args.tiny else (64, 4096)
    lengths = [tt.draw_lengths(gen, lo, hi, args.tokens) for _ in range(args.warmup + args.steps)]
    return [[torch.randint(0, cfg["vocab_size"], (n,), generator=gen) for n in lens] for lens in lengths]


def loss_fn(out: dict[str, torch.Tensor], mb: Any, ctx: Any) -> tuple[torch.Tensor, dict]:
    """``train_throughput.run_engine``'s loss: token-mean -log_prob with the global normalisation."""
    lp = out["log_probs"]
    return -(lp * mb.loss_mask.to(lp.device)).sum() / ctx.global_num_tokens * ctx.dp_size, {}


# ---------------------------------------------------------------------------------------------- the runs
def run_megatron(
    name: str,
    args: argparse.Namespace,
    model_dir: str,
    cfg: dict[str, Any],
    device: torch.device,
    ceiling: float,
) -> dict[str, Any]:
    from posttrain.core.batch import PackedBatch
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.megatron import build
    from posttrain.megatron.config import McoreEngineConfig
    from posttrain.megatron.engine import MegatronLanguageModelEngine

    engine_cfg = McoreEngineConfig(
        dtype="float32" if args.tiny else "bfloat16",
        use_distributed_optimizer=True,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=args.tokens,
        **LAYOUTS[name],
    )
    optim = OptimizerConfig(lr=1e-5, weight_decay=0.0)
    model = ModelConfig(
        path=model_dir, enable_gradient_checkpointing=False
    )  # as the FSDP run (no --grad-ckpt)
    eng = MegatronLanguageModelEngine(model, engine_cfg, optim, CheckpointConfig())
    eng.initialize()
    if name == "megatron_fsdp_wgrad":  # an experiment: the engine fuses under Megatron DDP only
        build.fuse_te_wgrad(eng.chunks, eng.provider, eng.engine_config, megatron_fsdp=True)
    per_dp = dist.get_world_size() // eng.get_data_parallel_size()  # GPUs of one data-parallel rank
    gpus = range(eng.get_data_parallel_rank() * per_dp, (eng.get_data_parallel_rank() + 1) * per_dp)
    draws = [gpu_sequences(args, cfg, g) for g in gpus]
    batches = [PackedBatch.from_sequences([s for d in draws for s in d[i]]) for i in range(len(draws[0]))]
    norms: list[float] = []  # the first steps' grad norms: same data and init in every Megatron run

    def step(b: PackedBatch) -> None:
        norms.append(round(float(eng.train_batch(b, loss_fn).get("metrics", {}).get("grad_norm", "nan")), 5))

    with eng.train_mode():
        sec, timed = tt.timed_loop(step, batches, args.warmup, device)
        profiled = {}
        if args.profile:
            profiled = tt.print_profile(lambda: eng.train_batch(batches[-1], loss_fn), device)
    # one rank per data-parallel rank counts its tokens (the others of its model-parallel group hold copies)
    timed_lengths = [b.seqlens if eng.is_mp_src_rank_with_outputs() else [] for b in timed]
    result = tt.summarize(
        name, sec, timed_lengths, sum(map(sum, timed_lengths)), count_params(cfg), cfg, ceiling, device
    )
    te = any(  # Megatron's TE wrappers subclass TE's modules
        k.__module__.startswith("transformer_engine")
        for c in eng.chunks
        for m in c.modules()
        for k in type(m).__mro__
    )
    fused = sum(bool(getattr(m, "fuse_wgrad_accumulation", False)) for c in eng.chunks for m in c.modules())
    result |= {"dp": eng.get_data_parallel_size(), "te_layers": te, "grad_norms": norms[:2]}
    result |= {"te_wgrad_fused": fused}
    return result | ({"profile": profiled} if profiled else {})


def run_fsdp(
    args: argparse.Namespace, model_dir: str, cfg: dict[str, Any], device: torch.device, ceiling: float
):
    """``train_throughput.run_engine`` with ``--compile-layers`` (no torch.compile with ``--tiny``)."""
    argv = ["--tokens", str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--tiny", "--no-compile"] if args.tiny else ["--compile-layers"]
    argv += ["--profile"] if args.profile else []
    return tt.run_engine(tt.parse_args(argv), model_dir, cfg, device, ceiling) | {"run": "fsdp_engine"}


def run(
    name: str, args: argparse.Namespace, cfg: dict[str, Any], device: torch.device, ceiling: float
) -> dict:
    """One run's result; an error (on every rank: a deterministic one) becomes the result."""
    if name.startswith("megatron_fsdp") and device.type != "cuda":
        return {"run": name, "gpus": dist.get_world_size(), "skipped": "Megatron-FSDP needs CUDA"}
    if (
        name in ("megatron_tp1_fp8", "megatron_tp1_unfused_wgrad", "megatron_fsdp_wgrad")
        and not has_real_te()
    ):
        return {"run": name, "gpus": dist.get_world_size(), "skipped": f"{name} needs Transformer Engine"}
    try:
        if name == "fsdp_engine":
            return run_fsdp(args, args.model_dir, cfg, device, ceiling)
        return run_megatron(name, args, args.model_dir, cfg, device, ceiling)
    except Exception as exc:  # reported as a result: the other runs still count
        traceback.print_exc()
        return {
            "run": name,
            "gpus": dist.get_world_size(),
            "error": f"{type(exc).__name__}: {str(exc)[:300]}",
        }
    finally:
        if name in LAYOUTS:  # the next Megatron run sets up its own parallel state
            from megatron.core import parallel_state as mpu

            mpu.destroy_model_parallel()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def has_real_te() -> bool:
    """Megatron-Core found a working Transformer Engine in this process (not the tests' stand-in)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


# ---------------------------------------------------------------------------------------------- launch
def worker(args: argparse.Namespace) -> None:
    from megatron_cpu import hide_transformer_engine, prepare_environment

    if args.hide_te:
        hide_transformer_engine()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    # the TE stand-in unless TE is installed; on CPU Megatron-Core's torch.cuda calls redirected
    prepare_environment()
    cfg = tt.TINY if args.tiny else tt.FULL
    if dist.get_rank() == 0:
        make_model(args.model_dir, cfg, device, args.tiny)
    dist.barrier()
    ceiling = args.ceiling_flops
    if ceiling is None:
        box = [tt.matmul_ceiling(device, torch.float32 if args.tiny else torch.bfloat16, args.tiny)]
        dist.broadcast_object_list(box)  # rank 0's number for every rank
        ceiling = box[0]
    results = [
        {"run": "matmul_ceiling", "gpus": 1, "tflops_per_gpu": round(ceiling / 1e12, 3), "flops": ceiling}
    ]
    names = [n for n in RUNS[dist.get_world_size()] if args.runs is None or n in args.runs.split(",")]
    for name in names:
        results.append(run(name, args, cfg, device, ceiling))
        if dist.get_rank() == 0:  # after every run, so a later failure or timeout keeps the rest
            Path(args.result_file).write_text(json.dumps(results))
            print("RESULT " + json.dumps(results[-1]), flush=True)
    dist.destroy_process_group()


def torchrun(n: int, argv: list[str]) -> list[dict[str, Any]]:
    """Run this script on ``n`` processes; its results (a failed launch as a result too)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_file = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([*cmd, __file__, *argv, "--result-file", result_file], env=env)
    got = json.loads(Path(result_file).read_text() or "[]")
    return got + (
        [{"run": "launch_failed", "gpus": n, "returncode": proc.returncode}] if proc.returncode else []
    )


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table of the runs, with each Megatron run's MFU over the FSDP engine's at the same GPU
    count."""
    fsdp = {r["gpus"]: r["mfu"] for r in results if r["run"] == "fsdp_engine" and "mfu" in r}
    lines = ["| run | GPUs | tokens/s | TFLOP/s/GPU | MFU | vs_fsdp | peak GiB | s/step |", "|---" * 8 + "|"]
    for r in results:
        if "mfu" not in r:
            continue
        vs = round(r["mfu"] / fsdp[r["gpus"]], 2) if r["gpus"] in fsdp and r["run"] != "fsdp_engine" else ""
        r["vs_fsdp"] = vs or None
        cells = [r["run"], r["gpus"], r["real_tokens_per_s"], r["tflops_per_gpu"], r["mfu"], vs]
        lines.append("| " + " | ".join(map(str, [*cells, r["peak_mem_gib"], r["sec_per_step"]])) + " |")
    return "\n".join(lines)


def kernel_table(results: list[dict[str, Any]]) -> str:
    """Markdown table of the profiled step's kernel time (ms) by kind, one column per run (``--profile``)."""
    runs = [r for r in results if r.get("profile", {}).get("kernel_ms")]
    if not runs:
        return ""
    kinds = list(dict.fromkeys(k for r in runs for k in r["profile"]["kernel_ms"]))
    head = "| kernel ms | " + " | ".join(f"{r['run']} ({r['gpus']})" for r in runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    for kind in [*kinds, "total"]:
        cells = [
            r["profile"]["kernel_ms"].get(kind, 0.0)
            if kind != "total"
            else round(sum(r["profile"]["kernel_ms"].values()), 2)
            for r in runs
        ]
        lines.append(f"| {kind} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def launches(args: argparse.Namespace, counts: list[int]) -> list[tuple[int, list[str]]]:
    """(processes, extra arguments) of each launch: one per run and GPU count, and where Transformer Engine
    is installed and the 1-GPU Megatron run is asked for, one more that runs it with TE hidden
    (``megatron_tp1_no_te``). Each run has a process of its own: the FSDP engine after three Megatron runs in
    one process measured 0.344 real-token MFU against 0.408 alone on the same H100 (the earlier runs left
    memory behind: its peak read 63.6 GiB against 40.5)."""
    wanted = args.runs.split(",") if args.runs else [r for n in counts for r in RUNS[n]]
    out = [(n, ["--runs", r]) for n in counts for r in RUNS[n] if r in wanted]
    if (
        1 in counts
        and "megatron_tp1" in wanted
        and not args.hide_te
        and importlib.util.find_spec("transformer_engine")
    ):
        out.append((1, ["--hide-te", "--runs", "megatron_tp1"]))
    return out


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """One torchrun launch per run; the first measures the matmul ceiling, the later ones reuse it."""
    counts = [int(c) for c in args.gpus.split(",")]
    if not args.tiny and torch.cuda.device_count() < max(counts):
        raise SystemExit(
            f"--gpus {args.gpus} needs {max(counts)} GPUs, this machine has {torch.cuda.device_count()}"
        )
    model_dir = args.model_dir or (
        tempfile.mkdtemp(prefix="bench_model_") if args.tiny else "/tmp/qwen25_15b_shape"
    )
    results: list[dict[str, Any]] = []
    for n, extra in launches(args, counts):
        ceiling = next((r["flops"] for r in results if r["run"] == "matmul_ceiling"), None)
        got = torchrun(
            n,
            [
                *argv,
                *extra,
                "--model-dir",
                model_dir,
                *(["--ceiling-flops", repr(ceiling)] if ceiling else []),
            ],
        )
        if "--hide-te" in extra:  # the TE-less baseline: its own name in the table
            got = [r | {"run": "megatron_tp1_no_te"} if r["run"] == "megatron_tp1" else r for r in got]
        results += [r for r in got if not (r["run"] == "matmul_ceiling" and ceiling)]
        if args.out:  # after every launch, so a timeout in a later one keeps these
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    print(kernel_table(results))
    for r in results:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> None:
    use_repo_sources()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.result_file:
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
