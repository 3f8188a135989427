"""Training throughput of the megatron engine on a Qwen2.5-1.5B-shaped model (random init, bf16).

Run under torchrun on 1 or 2 GPUs::

    torchrun --nproc-per-node 1 bench/megatron_throughput.py --layout tp1
    torchrun --nproc-per-node 2 bench/megatron_throughput.py --layout tp2
    torchrun --nproc-per-node 2 bench/megatron_throughput.py --layout fsdp

Each step trains on ``--seqs`` sequences of ``--seq-len`` tokens per data-parallel rank (packed THD, split into
micro-batches of ``--micro-tokens``), with the engine's token-mean NLL. Real-token MFU counts
6 * params * tokens + 12 * layers * hidden * seq_len * tokens FLOPs against ``--peak-tflops`` per GPU (782 =
the measured bf16 matmul ceiling of an H200). Without Transformer Engine on the machine, the script registers
the test suite's TE stand-in (Megatron-Bridge imports TE unconditionally) and the local layer spec runs with
variable-length flash attention.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layout", choices=["tp1", "tp2", "fsdp"], required=True)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=782.0)
    p.add_argument("--model-dir", default="/tmp/qwen25_15b_shape")
    return p.parse_args()


def _make_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (Path(path) / "config.json").is_file():
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_15B), dtype=torch.bfloat16)
    model.save_pretrained(path)


def main() -> None:
    args = _args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "engine-megatron" / "tests"))
    from megatron_cpu import nll_loss, prepare_environment

    from posttrain.core.batch import PackedBatch
    from posttrain.core.config import CheckpointConfig, McoreEngineConfig, ModelConfig, OptimizerConfig
    from posttrain.megatron.engine import MegatronLanguageModelEngine

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 0:
        _make_model(args.model_dir)
    torch.distributed.barrier()
    prepare_environment()
    layout = {
        "tp1": {},
        "tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        "fsdp": dict(use_megatron_fsdp=True),
    }[args.layout]
    cfg = McoreEngineConfig(
        dtype="bfloat16",
        use_distributed_optimizer=True,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=args.micro_tokens,
        **layout,
    )
    eng = MegatronLanguageModelEngine(
        ModelConfig(path=args.model_dir), cfg, OptimizerConfig(lr=1e-5, weight_decay=0.0), CheckpointConfig()
    )
    eng.initialize()
    dp = eng.get_data_parallel_size()
    g = torch.Generator().manual_seed(eng.get_data_parallel_rank())
    seqs = [
        torch.randint(0, QWEN25_15B["vocab_size"], (args.seq_len,), generator=g) for _ in range(args.seqs)
    ]
    batch = PackedBatch.from_sequences(seqs)
    times = []
    with eng.train_mode():
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = eng.train_batch(batch, nll_loss)
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
    n_params = 1_543_714_304  # Qwen2.5-1.5B shape, tied embeddings (embedding 233.4M + 28 x 46.8M + norm)
    tokens = args.seqs * args.seq_len * dp
    flops = (
        6 * n_params * tokens
        + 12 * QWEN25_15B["num_hidden_layers"] * QWEN25_15B["hidden_size"] * args.seq_len * tokens
    )
    step_s = sum(times) / len(times)
    result = dict(
        layout=args.layout,
        gpus=world,
        dp=dp,
        tokens_per_step=tokens,
        step_ms=round(step_s * 1e3, 1),
        tokens_per_s=round(tokens / step_s),
        mfu=round(flops / step_s / (args.peak_tflops * 1e12 * world), 3),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
        last_loss=round(sum(out.get("loss", [float("nan")])), 4) if out else None,
    )
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
