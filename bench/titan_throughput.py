"""Real-token MFU of the TorchTitan engine against the FSDP engine: same Qwen3 shape, same packed data, one
launch.

The arms (``--arms``, default ``fsdp,torchtitan``) are engines built once each from the same random HF
checkpoint, FSDP2 over the launch's ranks, bf16 compute / fp32 master weights and reductions (fp32 with
``--shape tiny``), no recomputation (``model.enable_gradient_checkpointing=false``):

- ``fsdp``: ``FSDPLanguageModelEngine`` with the engine's defaults;
- ``fsdp_hf_norm``: the same with ``engine.fused_rms_norm=false`` (HF's RMSNorm modules, the engine before
  ``fused_rms_norm``); ``fsdp_compiled`` / ``fsdp_hf_norm_compiled``: those with
  ``engine.compile_layers=true``;
- ``torchtitan``: ``TorchTitanLanguageModelEngine`` (``--titan-compile``: its ``engine.compile``).

Each engine waits in host memory and is moved to the device for its own timed blocks, so every arm runs with
the same free memory. The arms run in turn (``--rounds``; the order rotates every round), each block
``--steps`` steps after ``--warmup`` untimed ones, on the same micro-batches: documents of lengths drawn
uniformly from 64..4096 (8..64 for tiny) packed up to ``--tokens`` tokens per rank, a token-mean ``-log_prob``
loss.

Reported per arm (the median block, and every block): seconds per step, real tokens/s and MFU = model
FLOPs / time / (matmul ceiling x ranks), FLOPs = 6 N tokens + 12 layers (heads x head_dim) sum(len^2) on real
tokens (recomputation not counted), the ceiling a dense matmul measured first in the same process; each arm's
MFU over the first arm's, and the TorchTitan/FSDP MFU ratio when both run.

Shapes (``--shape``): ``1.7b`` Qwen3-1.7B (hidden 2048, 28 layers, 16 heads x 128, 8 KV heads, FFN 6144, vocab
151936, tied), ``0.6b`` Qwen3-0.6B, ``tiny`` (2 layers, CPU/gloo when no GPU: a correctness run, no timing
claims)::

    uv run python bench/titan_throughput.py --shape tiny --arms fsdp_hf_norm,fsdp,torchtitan   # CPU check
    python bench/titan_throughput.py --shape 1.7b --gpus 1 --out titan.json              # GPU machine
    python bench/titan_throughput.py --shape 1.7b --gpus 1 --rounds 3 --arms fsdp_hf_norm,fsdp,torchtitan

On the GPU machine torchtitan and its small needs come as wheels: ``scripts/titan_wheels.sh`` downloads them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=512),
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, vocab_size=151936),
}  # fmt: skip
FSDP_ARMS: dict[str, dict[str, Any]] = {
    "fsdp": {},
    "fsdp_hf_norm": {"fused_rms_norm": False},
    "fsdp_compiled": {"compile_layers": True},
    "fsdp_hf_norm_compiled": {"fused_rms_norm": False, "compile_layers": True},
}
"""FSDP engine arms: the engine's defaults, and engine options a user sets the same way (``engine.<key>``)."""
ARMS = (*FSDP_ARMS, "torchtitan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.7b", help="Qwen3 shape (tiny: a CPU check)")
    p.add_argument(
        "--gpus", type=int, default=1, help="ranks of the torchrun launch (CPU processes on a CPU)"
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating timed blocks per arm")
    p.add_argument("--steps", type=int, default=None, help="timed steps per block (default 5; 2 with tiny)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before each block (default 2; 1)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch and rank (default 16384)")
    p.add_argument("--titan-compile", action="store_true", help="torchtitan arm: engine.compile (per block)")
    p.add_argument(
        "--arms",
        default="fsdp,torchtitan",
        help=f"comma-separated arms of {', '.join(ARMS)} (module docstring)",
    )
    p.add_argument(
        "--model-dir", default=None, help="reuse this HF checkpoint instead of writing a random one"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = args.shape == "tiny"
    args.steps = args.steps or (2 if tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    args.tokens = args.tokens or (256 if tiny else 16384)
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms {','.join(args.arms)}: name each of {', '.join(ARMS)} at most once")
    return args


def hf_config(shape: str) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **SHAPES[shape],
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )


def write_model(shape: str, out: str) -> str:
    """A random Qwen3 of ``shape`` saved as an HF directory (bf16 safetensors; fp32 for tiny)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = torch.float32 if shape == "tiny" else torch.bfloat16
    AutoModelForCausalLM.from_config(hf_config(shape), dtype=dtype).save_pretrained(out)
    return out


def model_flops(num_params: int, shape: str, lengths: list[int]) -> float:
    """6 N tokens + 12 layers (heads x head_dim) sum(len^2), real tokens only."""
    s = SHAPES[shape]
    width = s["num_attention_heads"] * s["head_dim"]
    return 6 * num_params * sum(lengths) + 12 * s["num_hidden_layers"] * width * sum(n * n for n in lengths)


def build_engine(arm: str, args: argparse.Namespace, model_dir: str) -> Any:
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig

    common = dict(dtype="float32" if args.shape == "tiny" else "bfloat16", max_token_len_per_gpu=args.tokens)
    if arm in FSDP_ARMS:
        from posttrain.fsdp.config import FSDP2EngineConfig
        from posttrain.fsdp.engine import FSDPLanguageModelEngine as Engine

        cfg: Any = FSDP2EngineConfig(**common, **FSDP_ARMS[arm])
    else:
        from posttrain.torchtitan.config import TorchTitanEngineConfig
        from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine as Engine

        cfg = TorchTitanEngineConfig(**common, compile=args.titan_compile)
    model = ModelConfig(path=model_dir, enable_gradient_checkpointing=False)
    eng = Engine(model, cfg, OptimizerConfig(lr=1e-5), CheckpointConfig())
    eng.initialize()
    eng.to("cpu")  # parked in host memory until its block
    return eng


def make_batches(args: argparse.Namespace, count: int) -> list[Any]:
    from posttrain.core.batch import PackedBatch

    sys.path.insert(0, str(ROOT / "bench"))
    from train_throughput import draw_lengths

    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    lo, hi = (8, 64) if args.shape == "tiny" else (64, 4096)
    vocab = SHAPES[args.shape]["vocab_size"]
    lengths = [draw_lengths(gen, lo, hi, args.tokens) for _ in range(count)]
    return [
        PackedBatch.from_sequences([torch.randint(0, vocab, (n,), generator=gen) for n in lens])
        for lens in lengths
    ]


def loss_fn(out: dict[str, torch.Tensor], mb: Any, ctx: Any) -> tuple[torch.Tensor, dict]:
    return -(out["log_probs"] * mb.loss_mask).sum() / ctx.global_num_tokens * ctx.dp_size, {}


def block(eng: Any, batches: list[Any], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One timed block (the engine moved to ``device`` first and parked again after): seconds per step, and
    real tokens summed over all ranks."""
    from train_throughput import timed_loop

    eng.to(device)
    with eng.train_mode():
        sec, timed = timed_loop(lambda b: eng.train_batch(b, loss_fn), batches, args.warmup, device)
    eng.to("cpu")
    lengths: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lengths, [n for b in timed for n in b.seqlens])
    flat = [n for lens in lengths for n in lens]
    return {"sec": sec, "steps": len(timed), "lengths": flat}


def num_params(shape: str) -> int:
    """Parameters of the ``shape`` model (the tied embedding counted once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(shape)).parameters())


def report(
    blocks: dict[str, list[dict[str, Any]]], args: argparse.Namespace, ceiling: float
) -> dict[str, Any]:
    """Per arm: every block's s/step, real tokens/s and MFU, and the median MFU; MFU ratios to the first
    arm."""
    world, params = dist.get_world_size(), num_params(args.shape)
    result: dict[str, Any] = {"shape": args.shape, "ranks": world, "ceiling_tflops": ceiling / 1e12}
    for arm, arm_blocks in blocks.items():
        runs = []
        for b in arm_blocks:
            flops = model_flops(params, args.shape, b["lengths"]) / b["steps"] / b["sec"]
            runs.append({"sec_per_step": round(b["sec"], 4),
                         "real_tokens_per_s": round(sum(b["lengths"]) / b["steps"] / b["sec"], 1),
                         "mfu": round(flops / (ceiling * world), 4)})  # fmt: skip
        result[arm] = {"median_mfu": statistics.median(r["mfu"] for r in runs), "blocks": runs}
    first = args.arms[0]
    result[f"mfu_over_{first}"] = {
        arm: round(result[arm]["median_mfu"] / result[first]["median_mfu"], 3) for arm in args.arms[1:]
    }
    if "fsdp" in blocks and "torchtitan" in blocks:
        result["titan_over_fsdp_mfu"] = round(
            result["torchtitan"]["median_mfu"] / result["fsdp"]["median_mfu"], 3
        )
    return result


def worker(args: argparse.Namespace) -> None:
    from train_throughput import matmul_ceiling

    from posttrain.torchtitan.engine import ensure_process_group

    ensure_process_group()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    dtype = torch.float32 if args.shape == "tiny" else torch.bfloat16
    ceiling = matmul_ceiling(device, dtype, args.shape == "tiny")
    engines = {arm: build_engine(arm, args, args.model_dir) for arm in args.arms}
    batches = make_batches(args, args.warmup + args.steps)
    blocks: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    for r in range(args.rounds):  # the order rotates every round
        shift = r % len(args.arms)
        for arm in args.arms[shift:] + args.arms[:shift]:
            blocks[arm].append(block(engines[arm], batches, args, device))
    result = {**report(blocks, args, ceiling), "device": device.type}
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=2), flush=True)
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Write the model (unless given), then run :func:`worker` under torchrun with ``--gpus`` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or write_model(args.shape, str(Path(tmp) / "model"))
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.gpus), __file__, *argv,
               "--model-dir", model_dir, "--result-file", str(result_file)]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "POSTTRAIN_TITAN_WORKER": "1",
        }
        subprocess.run(cmd, check=True, env=env)
        result = json.loads(result_file.read_text())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    if os.environ.get("POSTTRAIN_TITAN_WORKER"):
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
