"""LoRA roles: record the peft adapter config at save time, and turn a peft state into HF weights or an
adapter.

A role trained with peft LoRA is checkpointed under the peft module's names:
``base_model.model.<hf name>`` for every weight, with each adapted linear layer ``P`` split into
``P.base_layer.weight`` (frozen) and ``P.lora_A.<adapter>.weight`` / ``P.lora_B.<adapter>.weight``, and
``P.modules_to_save.<adapter>.*`` / ``P.original_module.*`` for fully trained copies. :func:`peft_config_of`
reads the module's ``peft_config`` (a peft model, also under FSDP1/FSDP2) so the role manifest records it.

:func:`merge_lora` gives the base model's HF names with every adapted weight merged as peft's
``merge_and_unload`` does: ``W + (B @ A) * scale``, ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), ``r`` being A's row count; for fp16/bf16 the delta is computed in fp32 and cast back, as peft
does on the CPU. :func:`adapter_state` gives the adapter tensors under the names peft's ``save_pretrained``
writes (``...q_proj.lora_A.weight``, the adapter name removed), for a peft adapter directory; parameters
trained in full are not in it.
Only plain linear LoRA with one adapter is handled; DoRA, LoRA biases, per-module rank/alpha patterns,
``fan_in_fan_out`` and embedding adapters raise ValueError.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


def peft_config_of(model: torch.nn.Module) -> dict[str, dict[str, Any]] | None:
    """``{adapter name: LoraConfig as a JSON-ready dict}`` of a peft model (also FSDP-wrapped), else None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return {name: json.loads(json.dumps(cfg.to_dict(), default=_jsonable)) for name, cfg in configs.items()}


def _jsonable(obj: Any) -> Any:
    return sorted(obj) if isinstance(obj, (set, frozenset)) else str(obj)


def is_lora_state(state: dict[str, Any]) -> bool:
    """True when ``state`` holds peft LoRA tensors."""
    return any(".lora_A." in k or ".lora_embedding_A." in k for k in state)


def single_adapter(peft_config: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The one LoRA adapter of ``peft_config`` (name, config); ValueError for anything it cannot merge."""
    if len(peft_config) != 1:
        raise ValueError(
            f"the checkpoint has {len(peft_config)} peft adapters ({sorted(peft_config)}): export-hf merges "
            "exactly one; export each adapter from a role saved with that adapter alone"
        )
    name, cfg = next(iter(peft_config.items()))
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r} is {cfg.get('peft_type')}, not LORA: export-hf only merges LoRA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(
                f"adapter {name!r} uses {what} ({key}={cfg[key]!r}), which export-hf cannot merge: "
                "export with --adapter-only and merge with peft's merge_and_unload"
            )
    return name, cfg


def hf_name(name: str, adapter: str) -> str:
    """A peft module's state name -> the base model's HF name (``base_layer``/``modules_to_save`` removed)."""
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")


def merge_lora(
    state: dict[str, torch.Tensor], peft_config: dict[str, dict[str, Any]]
) -> dict[str, torch.Tensor]:
    """Base-model HF weights with every LoRA adapter of ``state`` merged in (see the module docstring)."""
    adapter, cfg = single_adapter(peft_config)
    if any(".lora_embedding_A." in k for k in state):
        raise ValueError("the checkpoint adapts an embedding (lora_embedding_A): export with --adapter-only")
    suffix_a = f".lora_A.{adapter}.weight"
    out = {
        hf_name(k, adapter): v for k, v in state.items() if ".lora_" not in k and ".original_module." not in k
    }
    for key_a in (k for k in state if k.endswith(suffix_a)):
        layer = key_a[: -len(suffix_a)]
        a, b = state[key_a], state[f"{layer}.lora_B.{adapter}.weight"]
        r = a.shape[0]
        scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
        base = out[hf_name(f"{layer}.base_layer.weight", adapter)]
        out[hf_name(f"{layer}.base_layer.weight", adapter)] = base + _delta(a, b, scale, base.dtype)
    return out


def _delta(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.float16, torch.bfloat16):
        return ((b.float() @ a.float()) * scale).to(dtype)
    return (b @ a) * scale


def adapter_state(state: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The LoRA tensors of ``state`` under peft's saved names (``.<adapter>`` removed). Parameters trained in
    full (``modules_to_save``, a value head) are not part of it."""
    return {k.replace(f".{adapter}.", "."): v for k, v in state.items() if ".lora_" in k}
