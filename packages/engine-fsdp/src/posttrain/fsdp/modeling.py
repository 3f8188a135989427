"""Build the Hugging Face model an FSDP engine trains, and fill its weights shard by shard.

``build_model`` makes the HF model (causal LM, or token classification with one label for a value model) with
the packed attention implementation, swaps its RMSNorm modules for fused ones (``engine.fused_rms_norm``,
:mod:`posttrain.fsdp.norms`), optionally wraps it in a peft LoRA model, replaces the causal LM's ``lm_head``
with
:class:`~posttrain.fsdp.logprobs.PackedLogProbHead` and turns on gradient checkpointing.

Two ways to get weights:

- ``meta=True`` (a model directory with safetensors, FSDP2 or a single process): every parameter is created on
  the meta device, the caller shards the model, materialises it with ``to_empty`` and then calls
  :func:`load_weights`, which reads one tensor at a time from the safetensors files (memory-mapped) and keeps
  only this rank's shard (``distribute_tensor(..., src_data_rank=None)`` slices locally, no communication).
  RoPE's non-persistent ``inv_freq`` buffers are recomputed with the model's own init. LoRA tensors come from
  the adapter file, or are drawn on the CPU from a generator seeded by ``seed`` and the parameter name (A:
  peft's kaiming-uniform, B: zeros), so every layout initialises the same adapter.
- ``meta=False`` (config-only random init, or FSDP1): the whole model is built on ``init_device`` after
  ``torch.manual_seed(seed)``, so every rank holds identical weights before sharding; a model directory's
  safetensors are then loaded with the same :func:`load_weights`.
"""

from __future__ import annotations

import inspect
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.core.config import EngineConfig, ModelConfig

from .attention import register_packed_attention
from .config import FSDPEngineConfig
from .logprobs import PackedLogProbHead

_PEFT_PREFIX = "base_model.model."
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def to_hf_name(name: str) -> str:
    """A parameter name of the (peft / FSDP-wrapped) module -> the base model's HF name."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def is_lora_name(name: str) -> bool:
    return ".lora_" in name


@dataclass
class BuiltModel:
    """The module to shard and what the engine needs to know about it."""

    module: torch.nn.Module
    """The HF model, or the peft model wrapping it."""
    hf_model: torch.nn.Module
    """The HF model inside (``module`` itself without LoRA)."""
    hf_config: Any
    """The HF config the model was built from (after ``override_config``)."""
    peft_config: Any
    """The peft ``LoraConfig`` or None."""
    on_meta: bool
    """True when parameters are still on the meta device (call ``to_empty`` then :func:`load_weights`)."""


def has_safetensors(path: str) -> bool:
    return bool(path) and any(Path(path).glob("*.safetensors"))


def load_hf_config(model_config: ModelConfig, value_model: bool) -> Any:
    """The HF config of ``model_config.path`` with ``override_config`` applied (and one label for values)."""
    from transformers import AutoConfig

    if not model_config.path or not (Path(model_config.path) / "config.json").is_file():
        raise ValueError(
            f"model.path={model_config.path!r} has no config.json: point it at a local Hugging Face "
            "model directory (config.json, plus safetensors unless you want a random init)"
        )
    config = AutoConfig.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
    if value_model:
        config.num_labels = 1
        config.classifier_dropout = 0.0
    for key, value in model_config.override_config.items():
        setattr(config, key, value)
    return config


def _lora_config(model_config: ModelConfig, value_model: bool) -> Any:
    from peft import LoraConfig

    if model_config.lora_adapter_path:
        cfg = LoraConfig.from_pretrained(model_config.lora_adapter_path)
        cfg.inference_mode = False
        return cfg
    exclude = model_config.exclude_modules
    if value_model:  # the value head is trained in full, never adapted
        if exclude is None:
            exclude = ["score"]
        elif isinstance(exclude, str):
            exclude = f"(?:{exclude})|(?:.*score)"
        else:
            exclude = [*exclude, "score"]
    target = model_config.target_modules
    return LoraConfig(
        task_type=None if value_model else "CAUSAL_LM",
        r=model_config.lora_rank,
        lora_alpha=model_config.lora_alpha,
        bias="none",
        target_modules=target if isinstance(target, str) else list(target),
        exclude_modules=exclude if exclude is None or isinstance(exclude, str) else list(exclude),
    )


def _nonpersistent_buffers_known(model: torch.nn.Module) -> bool:
    """True when every non-persistent buffer is a RoPE buffer that :func:`init_rope_buffers` recomputes."""
    for module in model.modules():
        if module._non_persistent_buffers_set and not hasattr(module, "original_inv_freq"):
            return False
    return True


def _fuse_rms_norms(model: torch.nn.Module, model_type: str) -> None:
    """``engine.fused_rms_norm``: :func:`posttrain.fsdp.norms.fuse_rms_norms`, the outcome printed on rank
    0."""
    import sys

    from .norms import FUSED_RMS_NORM_CLASSES, fuse_rms_norms

    count = fuse_rms_norms(model, model_type)
    if count:
        line = f"{count} {FUSED_RMS_NORM_CLASSES[model_type]} modules -> FusedRMSNorm (F.rms_norm)"
    else:
        known = ", ".join(sorted(FUSED_RMS_NORM_CLASSES))
        line = f"model_type={model_type!r} keeps HF's RMSNorm modules (fused for {known} only)"
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[posttrain] engine.fused_rms_norm: {line}", file=sys.stderr)


def build_model(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    *,
    value_model: bool,
    init_device: torch.device,
    meta: bool,
) -> BuiltModel:
    """Build the (LoRA-wrapped) HF model; see the module docstring for ``meta``."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = load_hf_config(model_config, value_model)
    auto = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    dtype = getattr(torch, getattr(engine_config, "model_dtype", "float32"))
    kwargs = {
        "dtype": dtype,
        "attn_implementation": register_packed_attention(),
        "trust_remote_code": model_config.trust_remote_code,
    }
    meta = meta and has_safetensors(model_config.path)
    if meta:
        with torch.device("meta"):
            model = auto.from_config(config, **kwargs)
        if not _nonpersistent_buffers_known(model):
            meta = False
    if not meta:
        torch.manual_seed(engine_config.seed)
        with torch.device(init_device):
            model = auto.from_config(config, **kwargs)
    if isinstance(engine_config, FSDPEngineConfig) and engine_config.fused_rms_norm:
        _fuse_rms_norms(model, config.model_type)
    module, peft_config = model, None
    if model_config.lora_rank > 0 or model_config.lora_adapter_path:
        from peft import get_peft_model

        peft_config = _lora_config(model_config, value_model)
        module = get_peft_model(model, peft_config)
        if value_model:
            model.score.requires_grad_(True)
    if not value_model:
        model.lm_head = PackedLogProbHead(model.lm_head, use_compile=engine_config.use_torch_compile)
    if model_config.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return BuiltModel(module, model, config, peft_config, meta)


def compile_decoder_layers(hf_model: torch.nn.Module, layers: tuple[type, ...]) -> int:
    """``torch.compile`` every decoder layer in place (``Module.compile``: names and hooks unchanged).

    ``dynamic=True`` makes the packed token count symbolic, so micro-batches of any length reuse one graph.
    FSDP2's hooks stay outside the compiled graphs (dynamo skips FSDP hooks by default). Returns the count."""
    count = 0
    for module in hf_model.modules():
        if isinstance(module, layers):
            module.compile(dynamic=True)
            count += 1
    return count


class SafetensorsReader:
    """Name -> tensor over the safetensors files of a directory, one memory-mapped tensor at a time."""

    def __init__(self, path: str | Path, filename_glob: str = "*.safetensors") -> None:
        from safetensors import safe_open

        self._files = {
            f: safe_open(str(f), framework="pt", device="cpu") for f in sorted(Path(path).glob(filename_glob))
        }
        self._where = {key: f for f, handle in self._files.items() for key in handle.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._files[self._where[name]].get_tensor(name)


def _seeded_init(name: str, shape: torch.Size, seed: int, std: float) -> torch.Tensor:
    """A full tensor for a parameter the files do not have, identical on every rank and layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if ".lora_B." in name or name.endswith("bias"):
        return torch.zeros(shape)
    if ".lora_A." in name:  # peft's default: kaiming_uniform_(a=sqrt(5)) -> bound = 1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if "norm" in name:
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if full.shape != target.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(full.shape)}, the model expects {tuple(target.shape)}"
        )
    if isinstance(target, DTensor):
        local = distribute_tensor(
            full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


@torch.no_grad()
def load_weights(
    module: torch.nn.Module, model_dir: str, *, adapter_dir: str | None, seed: int, init_std: float = 0.02
) -> dict[str, list[str]]:
    """Fill every parameter and persistent buffer of ``module`` (plain or DTensor) from the HF files.

    Names are mapped with :func:`to_hf_name`; LoRA tensors come from ``adapter_dir`` or a seeded init; weights
    the files lack (a fresh value head, say) are drawn by :func:`_seeded_init`. Returns the names that were
    initialised instead of loaded, and the file keys that were not used."""
    reader = SafetensorsReader(model_dir) if has_safetensors(model_dir) else None
    adapter = SafetensorsReader(adapter_dir, "adapter_model.safetensors") if adapter_dir else None
    done: set[int] = set()
    report: dict[str, list[str]] = {"initialised": [], "unused": []}
    used: set[str] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in done:  # tied weights appear under two names
            continue
        done.add(id(tensor))
        if is_lora_name(name) and adapter is not None:
            key = name.replace(".default.", ".")
            full = adapter.get(key) if key in adapter else None
        else:
            key = to_hf_name(name)
            full = (
                reader.get(key) if reader is not None and key in reader and not is_lora_name(name) else None
            )
        if full is None:
            full = _seeded_init(name, tensor.shape, seed, init_std)
            report["initialised"].append(name)
        else:
            used.add(key)
        _copy_into(tensor, full)
    if reader is not None:
        report["unused"] = [k for k in reader.keys() if k not in used]
    return report


def materialize(module: torch.nn.Module, device: torch.device | str) -> None:
    """``to_empty`` that keeps tied parameters tied (``to_empty`` gives each module its own new tensor)."""
    refs: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                refs.setdefault(id(param), []).append((sub, name))
    module.to_empty(device=device)
    for owners in refs.values():
        first = getattr(owners[0][0], owners[0][1])
        for sub, name in owners[1:]:
            if getattr(sub, name) is not first:
                setattr(sub, name, first)


@torch.no_grad()
def init_rope_buffers(hf_model: torch.nn.Module) -> None:
    """Recompute RoPE ``inv_freq`` buffers (non-persistent, so garbage after ``to_empty``).

    A fresh copy of each rotary module is built on the CPU from the model config (its own ``__init__``
    computes the buffers, whatever the RoPE type and transformers version) and its buffers are copied in."""
    for module in hf_model.modules():
        if not hasattr(module, "original_inv_freq"):
            continue
        if "config" in inspect.signature(type(module).__init__).parameters:
            with torch.device("cpu"):
                fresh = type(module)(config=module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)
            if hasattr(fresh, "attention_scaling"):
                module.attention_scaling = fresh.attention_scaling
        else:
            hf_model._init_weights(module)
