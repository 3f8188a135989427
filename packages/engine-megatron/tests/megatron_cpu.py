"""Test-only environment for running Megatron-Core / Megatron-Bridge without CUDA or Transformer Engine.

Megatron-Core 0.19 hard-codes ``torch.cuda`` calls (current device, seeding, RNG-state save/restore,
synchronize) and Megatron-Bridge imports ``transformer_engine.pytorch`` unconditionally. For CPU tests (and
for GPU runs on a machine without Transformer Engine) this module redirects those few calls to their CPU
equivalents and registers an empty Transformer Engine stand-in *after*
``megatron.core.models.gpt.gpt_layer_specs`` has been imported, so Megatron-Core has already recorded that TE
is absent and builds local (non-TE) layers, and tells Megatron-Bridge's PEFT (LoRA) that TE is absent too. The
posttrain package itself never does any of this; only tests and benchmarks call this.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import socket
import sys
import types

import torch

from posttrain.core.testing import tiny_model


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("Transformer Engine stand-in: this test environment has no Transformer Engine")


def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (_Unavailable,), {})

    mod.__getattr__ = __getattr__
    sys.modules[name] = mod
    return mod


def install_te_standin() -> None:
    """Register an empty ``transformer_engine`` after Megatron-Core decided it has no TE, then tell the
    bridge's PEFT that TE is absent: without TE, Megatron-Core exports mock TE linear classes, which the PEFT
    would pass to ``isinstance`` when it wraps a linear (LoRA). Nothing changes where a real TE was
    imported."""
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (records HAVE_TE=False first)

    if "transformer_engine" in sys.modules:
        return
    te = _stub_module("transformer_engine")
    te.__version__ = "0.0.0"
    te.pytorch = _stub_module("transformer_engine.pytorch")
    te.pytorch.ops = _stub_module("transformer_engine.pytorch.ops")
    te.common = _stub_module("transformer_engine.common")
    te.common.recipe = _stub_module("transformer_engine.common.recipe")
    import megatron.bridge.peft.utils as peft_utils  # imports the bridge (needs the stand-in above)

    peft_utils.HAVE_TE = False


class _CpuStream:
    """What Megatron's DDP wrapper asks of a CUDA stream, done synchronously on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args):
        return self

    def wait_event(self, *args):
        pass

    def query(self):
        return True


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CpuDeviceMode(torch.overrides.TorchFunctionMode):
    """Rewrite ``device='cuda'`` (and ``.cuda()``) in torch calls to the CPU: Megatron-Core allocates scratch
    tensors (loss scale, token counters, overflow flags) with a hard-coded CUDA device, and its grad clipping
    asserts ``grad.type() == 'torch.cuda.FloatTensor'``, so CPU tensors report CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # Megatron asserts grads are 'torch.cuda.FloatTensor'
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_MODE: list[CpuDeviceMode] = []


def _list_split_sizes(all_to_all_single):
    """``all_to_all_single`` taking split sizes as tensors too: the MoE dispatcher turns them into lists only
    when they were on a GPU, and c10d takes no tensors there. A wrapper, not the mode above: the
    activation-recompute backward (``model.enable_gradient_checkpointing``) calls it where the mode is not
    active."""

    def call(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        def listed(sizes):
            return sizes.tolist() if torch.is_tensor(sizes) else sizes

        return all_to_all_single(
            output, input, listed(output_split_sizes), listed(input_split_sizes), *args, **kwargs
        )

    return call


def redirect_cuda_to_cpu() -> None:
    """Point Megatron-Core's hard-coded ``torch.cuda`` calls at the CPU (CPU-only machines)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    if not _MODE:
        _MODE.append(CpuDeviceMode())
        _MODE[0].__enter__()
        torch.distributed.all_to_all_single = _list_split_sizes(torch.distributed.all_to_all_single)
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
        new_state
    )


class _HiddenTransformerEngine(importlib.abc.MetaPathFinder):
    """Refuses every ``transformer_engine`` import, as a machine without TE would."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by megatron_cpu)", name=name)
        return None


def hide_transformer_engine() -> None:
    """Make an installed Transformer Engine unimportable in this process, so that Megatron-Core records it
    absent and builds its local layer spec (a baseline next to TE's on the same machine). Call before anything
    imports Megatron or TE, then :func:`prepare_environment`."""
    if any(k == "transformer_engine" or k.startswith("transformer_engine.") for k in sys.modules):
        raise RuntimeError("hide_transformer_engine: transformer_engine is already imported in this process")
    sys.meta_path.insert(0, _HiddenTransformerEngine())


def prepare_environment() -> None:
    """Everything a test process needs before it touches Megatron-Bridge."""
    if not torch.cuda.is_available():
        redirect_cuda_to_cpu()
    install_te_standin()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process() -> None:
    """A one-rank gloo process group (what the engine needs outside torchrun)."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def make_tiny_qwen2(path: str, seed: int = 0, **overrides) -> str:
    """Save ``posttrain.core.testing``'s tiny Qwen2 (fp32, ``overrides`` applied) to ``path``, its biases and
    norms perturbed."""
    model = tiny_model(seed=seed, **overrides)
    with torch.no_grad():  # non-trivial biases and norms, so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def hf_log_probs(model, batch) -> torch.Tensor:
    """Reference: per-token log-probs of ``batch`` from an HF model, one sequence at a time (float64
    softmax)."""
    out = []
    for seq in batch.split_tokens(batch.input_ids):
        logits = model(seq[None]).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None]).squeeze(-1)
        out.append(torch.cat([torch.zeros(1, dtype=lp.dtype), lp]))
    return torch.cat(out)


def nll_loss(model_output, micro, ctx):
    """Token-mean negative log-likelihood over ``loss_mask`` with the global normalisation."""
    lp = model_output["log_probs"]
    loss = -(lp * micro.loss_mask.to(lp.device)).sum() / ctx.global_num_tokens * ctx.dp_size
    return loss, {"nll": float(loss.detach())}


def reference_step(hf_path: str, batch, lr: float, clip: float):
    """Plain HF + torch: token-mean NLL over the batch, its grad norm, one clipped AdamW step (no weight
    decay).

    Returns (loss, grad_norm, {hf name: updated parameter})."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    lp = hf_log_probs(model, batch)
    loss = -(lp * batch.loss_mask.double()).sum() / batch.loss_mask.sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    opt.step()
    return float(loss), float(norm), {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_engine(
    hf_path: str,
    cls_name: str = "MegatronLanguageModelEngine",
    ckpt=None,
    optim=None,
    model_kw=None,
    **engine_kw,
):
    """A megatron engine on ``hf_path`` (``model_kw``: more ModelConfig fields) in float32 with test-sized
    micro-batches."""
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.megatron import engine as engine_mod
    from posttrain.megatron.config import McoreEngineConfig

    kw = dict(
        dtype="float32", use_distributed_optimizer=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2
    )
    kw.update(engine_kw)
    eng = getattr(engine_mod, cls_name)(
        ModelConfig(path=hf_path, **(model_kw or {})),
        McoreEngineConfig(**kw),
        optim or OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0),
        ckpt or CheckpointConfig(),
    )
    eng.initialize()
    return eng


def sample_batch():
    """Four packed sequences of different lengths; the first two tokens of each are prompt (mask 0)."""
    from posttrain.core.batch import PackedBatch

    g = torch.Generator().manual_seed(1)
    lens = [7, 12, 5, 9]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lens]
    masks = [torch.cat([torch.zeros(2), torch.ones(n - 2)]) for n in lens]
    return PackedBatch.from_sequences(seqs, masks)


def trainer_assets(root, *, size: str, num_train: int, num_test: int, digits: int) -> dict:
    """A model of ``posttrain model init``'s ``size`` and the synthetic arithmetic task on disk under
    ``root``:
    ``{"root", "model", "train", "test"}`` (paths), what the trainer tests point their runs at."""
    from posttrain.trainers.data.convert import write_parquet
    from posttrain.trainers.data.synthetic import arithmetic_rows
    from posttrain.trainers.model_init import init_model

    splits = arithmetic_rows(num_train, num_test, digits=digits, seed=0)
    return {
        "root": root,
        "model": init_model(root / size, arch="qwen2", size=size, seed=0),
        "train": write_parquet(splits["train"], root / "data" / "train.parquet"),
        "test": write_parquet(splits["test"], root / "data" / "test.parquet"),
    }
