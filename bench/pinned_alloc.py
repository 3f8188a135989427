"""How much does allocating pinned host memory on a background thread stall the training thread?

The first async checkpoint save needs pinned host buffers as large as the state (18.5 GB for the 1.5B model
with AdamW). ``posttrain.ckpt`` allocates them on a background thread after the first step
(``prepare_role``). This script measures, for the 1.5B state's tensor shapes, the main thread's stand-in
training loop (bf16 matmuls, synchronised each iteration) while a background thread allocates the buffers by:

- ``cuda_host_alloc``: ``torch.empty(..., pin_memory=True)`` (PyTorch's caching host allocator,
  cudaHostAlloc);
- ``touch_then_register``: ``torch.empty`` + ``zero_()`` (pages mapped without the CUDA driver), then
  ``cudaHostRegister`` per tensor;
- ``touch_only``: ``torch.empty`` + ``zero_()``, no pinning (what the page faults alone cost).

It prints per method the allocation time, the probe's mean/max iteration time during it (vs idle), and the
device-to-host copy rate into the buffers (pinned memory copies at ~20+ GB/s, pageable at a few GB/s).
Command (GPU machine): ``python3 bench/pinned_alloc.py --json pinned.json``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import torch

HIDDEN, FFN, VOCAB, LAYERS, KV = 1536, 8960, 151936, 28, 256


def state_shapes() -> list[tuple[int, ...]]:
    """The 1.5B model's parameter shapes, three times (fp32 weights, Adam's two moments)."""
    layer = [(HIDDEN, HIDDEN), (HIDDEN,), (KV, HIDDEN), (KV,), (KV, HIDDEN), (KV,), (HIDDEN, HIDDEN)]
    layer += [(FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN), (HIDDEN,), (HIDDEN,)]
    model = [(VOCAB, HIDDEN), (VOCAB, HIDDEN), (HIDDEN,)] + layer * LAYERS
    return model * 3


def alloc_pinned(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.empty(s, dtype=torch.float32, pin_memory=True) for s in shapes]


def alloc_touched(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [torch.empty(s, dtype=torch.float32).zero_() for s in shapes]


def alloc_registered(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out = alloc_touched(shapes)
    cudart = torch.cuda.cudart()
    for t in out:
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
    return out


def probe_while(thread: threading.Thread, a: torch.Tensor) -> list[float]:
    times = []
    while thread.is_alive() or len(times) < 5:
        t0 = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def measure(name: str, alloc: Any, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    box: dict[str, Any] = {}

    def work() -> None:
        t0 = time.perf_counter()
        box["bufs"] = alloc(shapes)
        box["alloc_s"] = time.perf_counter() - t0

    idle = probe_while(threading.Thread(target=lambda: None), a)
    thread = threading.Thread(target=work)
    thread.start()
    during = probe_while(thread, a)
    thread.join()
    bufs = box["bufs"]
    src = torch.empty(max(b.numel() for b in bufs), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in bufs:
        b.view(-1).copy_(src[: b.numel()], non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    gb = sum(b.numel() * 4 for b in bufs) / 1e9
    if alloc is alloc_registered:
        for b in bufs:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
    return {
        "method": name,
        "gb": round(gb, 2),
        "alloc_s": round(box["alloc_s"], 2),
        "probe_idle_mean_ms": round(sum(idle) / len(idle) * 1e3, 2),
        "probe_during_mean_ms": round(sum(during) / len(during) * 1e3, 2),
        "probe_during_max_ms": round(max(during) * 1e3, 1),
        "probe_iters": len(during),
        "is_pinned": bool(bufs[0].is_pinned()),
        "d2h_gbps": round(gb / copy_s, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--methods", default="cuda_host_alloc,touch_then_register,touch_only")
    args = p.parse_args()
    methods = {
        "cuda_host_alloc": alloc_pinned,
        "touch_then_register": alloc_registered,
        "touch_only": alloc_touched,
    }
    shapes = state_shapes()
    results = []
    for name in args.methods.split(","):
        results.append(measure(name, methods[name], shapes))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
