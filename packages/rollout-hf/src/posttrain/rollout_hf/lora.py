"""LoRA adapter syncs for the HF rollout: merge streamed adapters into the base weights it holds.

With a LoRA actor an engine streams, as verl does, the base weights once (``peft_config`` given,
``base_sync_done=False``) and afterwards only the adapter tensors under peft's names
(``[base_model.model.]<module>.lora_A.weight`` / ``.lora_B.weight``, ``base_sync_done=True``). The rollout
keeps a copy of the base weight of every adapted module and sets ``W = W_base + scaling * B @ A`` (in float32,
then cast), so repeated syncs never accumulate. ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), with ``r`` and ``lora_alpha`` taken per module from ``rank_pattern`` / ``alpha_pattern`` as
peft does. DoRA, embedding adapters and ``modules_to_save`` are refused: stream merged weights for those.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from posttrain.core.weight_sync import WeightSyncError

_PREFIXES = ("base_model.model.",)
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def check_peft_config(peft_config: dict[str, Any]) -> None:
    """Raise a ValueError for adapter kinds the rollout cannot merge."""
    if peft_config.get("use_dora"):
        raise ValueError("the HF rollout cannot merge DoRA adapters: stream merged weights (peft_merge=True)")
    if peft_config.get("modules_to_save"):
        raise ValueError(
            "the HF rollout cannot take modules_to_save with an adapter sync: stream merged weights "
            "(peft_merge=True)"
        )
    if "r" not in peft_config or "lora_alpha" not in peft_config:
        raise ValueError(f"peft_config needs r and lora_alpha, got keys {sorted(peft_config)}")


def parse_adapter_name(name: str) -> tuple[str, str]:
    """``(module, "A" | "B")`` from a streamed adapter tensor name; anything else raises WeightSyncError."""
    for part in _WRAPPERS:
        name = name.replace(part, "")
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.default)?\.weight", name)
    if m is None:
        raise WeightSyncError(
            f"adapter sync sent {name!r}, which is not a LoRA linear weight (lora_A / lora_B): "
            "embedding adapters and extra modules need merged weights (peft_merge=True)"
        )
    return m.group(1), m.group(2)


def _pattern_value(pattern: dict[str, Any] | None, module: str, default: Any) -> Any:
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_scaling(peft_config: dict[str, Any], module: str) -> float:
    """peft's scaling of ``module``: ``alpha / r`` or ``alpha / sqrt(r)`` (rslora), patterns applied."""
    r = _pattern_value(peft_config.get("rank_pattern"), module, peft_config["r"])
    alpha = _pattern_value(peft_config.get("alpha_pattern"), module, peft_config["lora_alpha"])
    return alpha / math.sqrt(r) if peft_config.get("use_rslora") else alpha / r


class AdapterMerger:
    """Holds (on CPU) the base weights of adapted modules and writes ``base + scaling * B @ A`` into the
    model."""

    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def reset_bases(self) -> None:
        """The base weights were replaced: forget the saved copies."""
        self.bases.clear()

    def collect(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Keep copies of streamed adapter tensors (the bucket buffer is reused)."""
        for name, tensor in tensors:
            module, which = parse_adapter_name(name)
            self.pending.setdefault(module, {})[which] = tensor.clone()

    def merge(self, targets: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> int:
        """Merge every collected adapter; returns how many modules were written."""
        pending, self.pending = self.pending, {}
        stale = sorted(set(self.bases) - {f"{m}.weight" for m in pending})
        if stale:
            raise WeightSyncError(
                f"adapter sync left {len(stale)} adapted module(s) without an update, e.g. "
                f"{stale[:3]}: stream every adapter tensor"
            )
        with torch.no_grad():
            for module, pair in sorted(pending.items()):
                if set(pair) != {"A", "B"}:
                    raise WeightSyncError(f"adapter sync sent only lora_{''.join(pair)} for {module!r}")
                name = f"{module}.weight"
                if name not in targets:
                    raise WeightSyncError(
                        f"adapter sync targets {name!r}, which the HF rollout model does not have"
                    )
                weight = targets[name]
                delta = pair["B"].float() @ pair["A"].float()
                if delta.shape != weight.shape:
                    raise WeightSyncError(
                        f"adapter for {name!r} gives shape {tuple(delta.shape)}, the weight has "
                        f"{tuple(weight.shape)}"
                    )
                base = self.bases.setdefault(name, weight.detach().to("cpu", copy=True))
                merged = base.to(weight.device).float() + lora_scaling(peft_config, module) * delta.to(
                    weight.device
                )
                weight.copy_(merged.to(weight.dtype))
        return len(pending)
