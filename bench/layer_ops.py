"""ATen ops per decoder layer of the FSDP engine (HF modules) and the TorchTitan engine, counted on a CPU.

Both engines are built as ``titan_throughput.py`` builds them (FSDP2 over one gloo rank, bf16 compute, fp32
master weights, no recomputation) from one random 2-layer Qwen3 checkpoint of ``--shape``'s widths (vocabulary
cut to 2,048), and each runs one document of ``--tokens`` tokens through ``forward_backward_batch`` (after an
untimed step) under a ``TorchDispatchMode`` that records every ATen op: its name, forward or backward, and the
bytes its tensor arguments and results hold. Module hooks say which region ran it (norm, attention, mlp, the
rest of the layer, or outside the decoder layers); a backward op belongs to the region whose forward created
its autograd node.
``--fsdp-arm hf_norm`` builds the FSDP engine with ``engine.fused_rms_norm=false`` (HF's RMSNorm modules).

Ops are classed as no kernel (views, allocations), matmul, attention, communication, host read
(``_local_scalar_dense``: a device sync on a GPU) and memory-bound (the rest). Each op's bytes at ``--tokens``
and at twice that give a line, read at ``--at`` tokens; memory-bound kernels are estimated at
bytes / ``--bandwidth`` + ``--launch-us`` each. Two estimates: ``cpu_path`` runs the ops this CPU ran;
``cuda_path`` counts each ``F.rms_norm`` call (which a CPU decomposes into HF's ops) as CUDA's one
``_fused_rms_norm`` kernel forward and one backward (2 and 3 tensors' bytes; 5 with a weight). Attention here
is one SDPA call per document and its ``cat``/``select``/``clone`` are that CPU loop's; on CUDA both engines
call the same varlen kernel::

    OMP_NUM_THREADS=1 uv run python bench/layer_ops.py --out /tmp/layer_ops.json        # about 2 minutes
    OMP_NUM_THREADS=1 uv run python bench/layer_ops.py --arms fsdp --fsdp-arm hf_norm
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from titan_throughput import SHAPES, loss_fn  # noqa: E402

NO_KERNEL = {
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "set_",
    "resize_",
    "detach",
    "lift_fresh",
    "_unsafe_view",
    "_record_function_enter_new",
    "_record_function_exit",
}
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
REGIONS = (("RMSNorm", "norm"), ("Attention", "attention"), ("MLP", "mlp"), ("FeedForward", "mlp"),
           ("DecoderLayer", "layer"), ("TransformerBlock", "layer"))  # fmt: skip
"""Module class names (substring) -> region; ops of other modules belong to the enclosing region."""
LAYERS = 2
"""Decoder layers of the counted model (per-layer numbers are its layers' ops / LAYERS)."""
Counts = dict[tuple[str, str, str, str], list[int]]
"""(inside a layer or outside, fwd or bwd, class, region/op) -> [count, bytes]."""
FUSED = "rms_norm_call"
"""Region of a ``torch.nn.functional.rms_norm`` call: decomposed on a CPU, one fused kernel each way on
CUDA."""


def op_class(func: Any) -> str:
    name = func.__name__.split(".")[0]
    if func.namespace in ("c10d", "_c10d_functional"):
        return "comm"
    if name == "_local_scalar_dense":
        return "host_read"
    returns = func._schema.returns
    if name in NO_KERNEL or (
        returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    ):
        return "no_kernel"  # allocations, profiler marks and views
    if name in MATMUL:
        return "matmul"
    if "attention" in name:
        return "attention"
    return "memory"


def _bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_bytes(o) for o in obj.values())
    return 0


def _where(label: str) -> str:
    return "layer" if "/layer" in label else "outside"


class Regions(TorchFunctionMode):
    """Which region (norm, attention, mlp, layer, rms_norm_call, or outside) runs now. Forward: a stack pushed
    by module hooks and by ``rms_norm`` calls. Backward: autograd nodes are numbered in creation order, so a
    node belongs to the innermost region whose forward created its number."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, int]] = [("", 0)]
        self.spans: list[tuple[int, int, str]] = []
        self.probing = False
        self.fused_calls: list[tuple[str, str, int]] = []
        self._probe = torch.zeros((), requires_grad=True)

    def seq(self) -> int:
        self.probing = True
        with torch.enable_grad():
            nr = self._probe.mul(1).grad_fn._sequence_nr()
        self.probing = False
        return nr

    def push(self, region: str | None) -> None:
        """Enter ``region`` (None: the enclosing one); labels are paths, e.g.
        ``/layer/norm/rms_norm_call``."""
        parent = self.stack[-1][0]
        self.stack.append((f"{parent}/{region}" if region else parent, self.seq()))

    def pop(self) -> None:
        label, start = self.stack.pop()
        self.spans.append((start, self.seq(), label))

    def pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        name = type(module).__name__
        self.push(next((region for key, region in REGIONS if key in name), None))

    def post_hook(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self.pop()

    def label_of(self, node: Any) -> str:
        if node is None:
            return self.stack[-1][0]
        nr = node._sequence_nr()
        inside = [(end - start, label) for start, end, label in self.spans if start <= nr < end]
        return min(inside)[1] if inside else ""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func not in (torch.nn.functional.rms_norm, torch.rms_norm):
            return func(*args, **(kwargs or {}))
        x, weight = args[0], args[2] if len(args) > 2 else (kwargs or {}).get("weight")
        x_bytes, where = x.numel() * x.element_size(), _where(self.stack[-1][0])
        self.fused_calls.append((where, "fwd", 2 * x_bytes))  # read x, write y
        if x.requires_grad:  # read dy, x and rstd, write dx; with a weight read dy and x again for dweight
            self.fused_calls.append((where, "bwd", (3 if weight is None else 5) * x_bytes))
        self.push(FUSED)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.pop()


class OpRecorder(TorchDispatchMode):
    """Every ATen op: (name, class, 'fwd' or 'bwd', region, bytes of its tensor arguments and results)."""

    def __init__(self, regions: Regions) -> None:
        super().__init__()
        self.regions = regions
        self.ops: list[tuple[str, str, str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self.regions.probing:
            return out
        node = torch._C._current_autograd_node()
        name = f"{func.namespace}::{func.__name__.split('.')[0]}"
        nbytes = _bytes(args) + _bytes(kwargs or {}) + _bytes(out)
        phase = "fwd" if node is None else "bwd"
        self.ops.append((name, op_class(func), phase, self.regions.label_of(node), nbytes))
        return out


def write_model(shape: str, out: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    dims = {**SHAPES[shape], "num_hidden_layers": LAYERS, "vocab_size": 2048}
    cfg = Qwen3Config(**dims, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def build(arm: str, model_dir: str, tokens: int, fsdp_options: dict[str, Any]) -> Any:
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig

    common = dict(dtype="bfloat16", max_token_len_per_gpu=tokens)
    if arm == "fsdp":
        from posttrain.fsdp.config import FSDP2EngineConfig
        from posttrain.fsdp.engine import FSDPLanguageModelEngine as Engine

        cfg: Any = FSDP2EngineConfig(**common, **fsdp_options)
    else:
        from posttrain.torchtitan.config import TorchTitanEngineConfig
        from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine as Engine

        cfg = TorchTitanEngineConfig(**common)
    model = ModelConfig(path=model_dir, enable_gradient_checkpointing=False)
    eng = Engine(model, cfg, OptimizerConfig(lr=1e-5), CheckpointConfig())
    eng.initialize()
    return eng


def record(eng: Any, tokens: int) -> Counts:
    """Ops of one ``forward_backward_batch`` on one document of ``tokens`` tokens (after one untimed step)."""
    from torch.nn.modules import module as nn_module

    from posttrain.core.batch import PackedBatch

    gen = torch.Generator().manual_seed(0)
    batch = PackedBatch.from_sequences([torch.randint(0, 2048, (tokens,), generator=gen)])
    with eng.train_mode():
        eng.train_batch(batch, loss_fn)
        eng.optimizer_zero_grad()
        regions = Regions()
        hooks = [nn_module.register_module_forward_pre_hook(regions.pre_hook),
                 nn_module.register_module_forward_hook(regions.post_hook)]  # fmt: skip
        try:
            with regions, OpRecorder(regions) as rec:
                eng.forward_backward_batch(batch, loss_fn, forward_only=False)
        finally:
            for h in hooks:
                h.remove()
    counts: Counts = collections.defaultdict(lambda: [0, 0])
    for name, cls, phase, label, nbytes in rec.ops:
        region = label.rsplit("/", 1)[-1] or "outside"
        key = (_where(label), phase, "fused_on_cuda" if region == FUSED else cls, f"{region}/{name}")
        counts[key][0] += 1
        counts[key][1] += nbytes
    for where, phase, nbytes in regions.fused_calls:  # what the CUDA kernel reads and writes instead
        key = (where, phase, "cuda_rms_norm", "norm/aten::_fused_rms_norm")
        counts[key][0] += 1
        counts[key][1] += nbytes
    return counts


def summary(small: Counts, large: Counts, args: argparse.Namespace, where: str) -> dict[str, Any]:
    """Kernels per phase and class (per layer: divided by LAYERS); memory-bound kernels' bytes extrapolated
    from ``--tokens`` and twice that to ``--at``, and the H200 estimate with the CPU's and CUDA's RMSNorm
    kernels."""
    per = LAYERS if where == "layer" else 1
    res: dict[str, Any] = {}
    for phase in ("fwd", "bwd"):
        keys = [k for k in set(small) | set(large) if k[0] == where and k[1] == phase]
        by_cls: dict[str, float] = collections.Counter()
        ops: dict[str, list[float]] = {}
        for k in keys:
            count, b0 = small.get(k, [0, 0])
            b1 = large.get(k, [0, 0])[1]
            nbytes = b0 + (b1 - b0) * (args.at - args.tokens) / args.tokens
            by_cls[k[2]] += count / per
            if k[2] in ("memory", "fused_on_cuda", "cuda_rms_norm"):
                ops[f"{k[2]}:{k[3]}"] = [count / per, round(nbytes / per / 1e6, 1)]
        res[phase] = {
            "kernels": {c: n for c, n in sorted(by_cls.items()) if c != "no_kernel"},
            "memory_ops": ops,
        }
        for label, skip in (("cpu_path", "cuda_rms_norm"), ("cuda_path", "fused_on_cuda")):
            rows = [v for k, v in ops.items() if not k.startswith(skip)]
            gb = sum(b for _, b in rows) / 1e3
            launches = sum(c for c, _ in rows)
            res[phase][label] = {"kernels": launches, "gb": round(gb, 3),
                                 "ms": round(gb * 1e9 / args.bandwidth * 1e3
                                             + launches * args.launch_us / 1e3, 3)}  # fmt: skip
    return res


def measure(arm: str, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    options = {"fused_rms_norm": False} if arm == "fsdp" and args.fsdp_arm == "hf_norm" else {}
    runs = []
    for tokens in (args.tokens, 2 * args.tokens):
        eng = build(arm, model_dir, tokens, options)
        runs.append(record(eng, tokens))
        del eng
    return {where: summary(*runs, args, where) for where in ("layer", "outside")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="1.7b", help="widths of titan_throughput's shapes"
    )
    p.add_argument(
        "--tokens", type=int, default=128, help="tokens of the counted micro-batch (and twice that)"
    )
    p.add_argument("--at", type=int, default=16384, help="token count the bytes are extrapolated to")
    p.add_argument("--bandwidth", type=float, default=3.5e12, help="bytes/s of a memory-bound kernel")
    p.add_argument("--launch-us", type=float, default=5.0, help="microseconds a kernel launch costs")
    p.add_argument(
        "--fsdp-arm", choices=("default", "hf_norm"), default="default", help="FSDP engine options"
    )
    p.add_argument("--arms", default="fsdp,torchtitan", help="comma-separated: fsdp, torchtitan")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    result: dict[str, Any] = {"shape": args.shape, "tokens": args.at, "fsdp_arm": args.fsdp_arm}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args.shape, f"{tmp}/model")
        for arm in args.arms.split(","):
            result[arm] = measure(arm, args, model_dir)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
