"""The rollout's weight stream: full tensors under HF names, gathered one at a time.

:func:`iter_rollout_tensors` walks the module's state dict in a fixed order. Each entry is a local shard
(a DTensor under FSDP2, and under FSDP1 with a ``SHARDED_STATE_DICT``); it is moved to the compute device,
gathered with ``full_tensor()`` only when the consumer asks for it, and cast to the rollout dtype, so peak
extra memory is one full tensor. Every rank must consume the stream to the end: each gather is a collective.

With LoRA there are three streams:

- ``merge=True``: base weights with the adapter folded in, ``W + scaling * B @ A`` (computed in fp32), under
  HF names, equal to peft's ``merge_and_unload``;
- ``adapter_only=False``: the base weights alone, under HF names (the rollout's base model);
- ``adapter_only=True``: only the adapter tensors, under peft's saved names (``...q_proj.lora_A.weight``).

Tied weights (an ``lm_head`` sharing the input embedding) are sent once, under the first name, as
``save_pretrained`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .modeling import _WRAPPER_PARTS, is_lora_name, to_hf_name


def _full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        if t.device_mesh.size() == 1:  # one shard is the whole tensor: no collective, no copy
            # the local tensor as ``to_local`` returns it under no_grad, without its grad-mode switch (about 7
            # of the 8 us per tensor this costs on a CPU host, 338 times a sync at 1.5B)
            local = t._local_tensor.detach()
            return local if local.device == device else local.to(device)
        return t.to(device).full_tensor()
    return t.detach().to(device)


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def lora_scalings(module: torch.nn.Module, adapter: str = "default") -> dict[str, float]:
    """Module name (no wrapper prefixes) -> LoRA scaling, for every LoRA linear layer."""
    out = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "lora_A") and adapter in getattr(sub, "scaling", {}):
            if adapter not in sub.lora_A:
                raise ValueError(
                    f"LoRA layer {name} has no {adapter!r} linear adapter: only linear LoRA layers "
                    "can be merged for the rollout"
                )
            out[_clean(name)] = float(sub.scaling[adapter])
    return out


def tied_duplicates(hf_model: torch.nn.Module) -> set[str]:
    """HF names of parameters that share their tensor with an earlier parameter (e.g. a tied ``lm_head``)."""
    seen: set[int] = set()
    out = set()
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            out.add(name)
        seen.add(id(param))
    return out


def iter_rollout_tensors(
    state: dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    scalings: dict[str, float],
    merge: bool,
    adapter_only: bool,
    skip: set[str],
    adapter: str = "default",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazy (name, full tensor) stream; see the module docstring for the three LoRA modes. HF names in
    ``skip`` (tied duplicates) are left out."""
    for name, tensor in state.items():
        if to_hf_name(name) in skip:
            continue
        if is_lora_name(name):
            if adapter_only and not merge:
                yield name.replace(f".{adapter}.", "."), _cast(_full(tensor, device), dtype)
            continue
        if adapter_only and not merge:
            continue
        full = _full(tensor, device)
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if merge and owner is not None and name.endswith(".base_layer.weight") and owner in scalings:
            a = _full(state[f"{owner}.lora_A.{adapter}.weight"], device).float()
            b = _full(state[f"{owner}.lora_B.{adapter}.weight"], device).float()
            full = (full.float() + scalings[owner] * (b @ a)).to(full.dtype)
        yield to_hf_name(name), _cast(full, dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def peft_config_dict(peft_config: Any) -> dict[str, Any]:
    """The LoRA config as a JSON-friendly dict (sets become sorted lists)."""
    out = {}
    for key, value in peft_config.to_dict().items():
        out[key] = sorted(value) if isinstance(value, set) else value
    return out
