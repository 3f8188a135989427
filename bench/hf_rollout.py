"""The HF rollout against plain ``model.generate`` on the same model and batch, timed in one run.

Both sample (temperature 1, no top-k / top-p) the same left-aligned batch of random prompts for exactly
``--new-tokens`` tokens: the model has no eos token, so neither stops early. ``model.generate`` is called on
the rollout's own model (``HFRollout.model``) with its default cache; the rollout adds what an RL step needs
(per-token log-probs, a seeded generator, stop tokens) and runs its device-side decode loop
(:mod:`posttrain.rollout_hf.decode`). Each is run once to warm up, then ``--repeats`` times; the report gives
the best and median seconds, tokens per second (new tokens only), peak memory and the ratio rollout / generate
(the target: at most 1.5).

Default (CUDA): a Qwen2.5-0.5B-shaped random model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocabulary 151,936) in bf16, 256 prompts x 256 tokens, 256 new tokens. ``--tiny``: a small model on the
CPU.
Run::

    PYTHONPATH=packages/engine-core/src:packages/rollout-hf/src \\
        python bench/hf_rollout.py [--compile] [--json out.json]
    uv run python bench/hf_rollout.py --tiny       # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from posttrain.core import testing

QWEN25_05B = dict(testing.QWEN25_05B, max_position_embeddings=32768, rope_theta=1_000_000.0)
"""The Qwen2.5 shape of ``posttrain.core.testing`` with the fields a model built from it needs."""
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small model, small batch, on the CPU")
    p.add_argument("--prompts", type=int, default=None, help="batch rows (default 256; --tiny 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 256; --tiny 16)")
    p.add_argument(
        "--new-tokens", type=int, default=None, help="tokens generated per row (default 256; --tiny 32)"
    )
    p.add_argument("--repeats", type=int, default=2, help="timed calls of each after one warm-up call")
    p.add_argument("--cache", default="static", choices=["static", "dynamic"], help="the rollout's KV cache")
    p.add_argument("--compile", action="store_true", help="torch.compile the rollout's decode step")
    p.add_argument("--json", default=None, help="write the results to this file")
    return p.parse_args()


def save_random_model(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> dict[str, float]:
    """Warm-up call, then ``repeats`` timed calls (synchronised); seconds and peak memory."""
    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {"best_s": min(times), "median_s": statistics.median(times), "peak_gib": peak}


def build_rollout(
    args: argparse.Namespace, shape: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> Any:
    """An HFRollout over a freshly saved random model of ``shape``, with no eos token."""
    from posttrain.rollout_hf import HFRollout
    from posttrain.rollout_hf.config import HFRolloutConfig

    with tempfile.TemporaryDirectory() as path:
        save_random_model(shape, dtype, device, path)
        config = HFRolloutConfig(
            dtype=str(dtype).removeprefix("torch."),
            prompt_length=args.prompt_len,
            response_length=args.new_tokens,
            cache=args.cache,
            compile=args.compile,
        )
        rollout = HFRollout(config, path, device=device)
    if rollout.eos_ids:
        raise RuntimeError("the benchmark model must have no eos token (both run to --new-tokens)")
    return rollout


def calls(rollout: Any, prompts: torch.Tensor, new: int) -> dict[str, Callable[[], None]]:
    """The two generation calls on the same batch, each checking that it made every token."""
    from posttrain.core import SamplingConfig

    rows, plen = prompts.shape
    as_lists, ids = prompts.tolist(), prompts.to(rollout.device)
    seeds = iter(range(1_000_000))

    def run_rollout() -> None:
        samples = rollout.generate(as_lists, SamplingConfig(max_new_tokens=new, seed=next(seeds)))
        assert sum(len(s.response_ids) for s in samples) == rows * new

    def run_generate() -> None:
        with torch.no_grad():
            out = rollout.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
        assert out.shape == (rows, plen + new)

    return {"generate": run_generate, "rollout": run_rollout}


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = TINY if args.tiny else QWEN25_05B
    args.prompts = args.prompts or (8 if args.tiny else 256)
    args.prompt_len = args.prompt_len or (16 if args.tiny else 256)
    args.new_tokens = args.new_tokens or (32 if args.tiny else 256)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, shape["vocab_size"], (args.prompts, args.prompt_len), generator=gen)
    rollout = build_rollout(args, shape, device, dtype)
    results = {
        name: timed(fn, device, args.repeats) for name, fn in calls(rollout, prompts, args.new_tokens).items()
    }
    for name, res in results.items():
        res["new_tokens_per_s"] = args.prompts * args.new_tokens / res["best_s"]
        print(
            f"{name:9s} best {res['best_s']:8.3f} s  median {res['median_s']:8.3f} s  "
            f"{res['new_tokens_per_s']:10.0f} new tok/s  peak {res['peak_gib']:6.2f} GiB"
        )
    ratio = results["rollout"]["best_s"] / results["generate"]["best_s"]
    print(f"ratio rollout / generate: {ratio:.2f} (target <= 1.5)")
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "shape": "tiny" if args.tiny else "qwen2.5-0.5b",
            "dtype": str(dtype),
            **{k: getattr(args, k) for k in ("prompts", "prompt_len", "new_tokens", "cache", "compile")},
            "results": results,
            "ratio_rollout_over_generate": ratio,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
