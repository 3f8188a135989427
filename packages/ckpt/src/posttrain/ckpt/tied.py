"""Tied parameters (one Parameter under several names) are written to DCP once.

``get_state_dict`` lists a tied parameter under every name it has (``model.embed_tokens.weight`` and
``lm_head.weight`` with ``tie_word_embeddings``), as separate tensors over the same memory, and DCP would
write each of them. :func:`tied_aliases` finds the aliases from the module itself: every name that
``named_parameters(remove_duplicate=False)`` / ``named_buffers(remove_duplicate=False)`` gives for the same
object, with FSDP1, activation-checkpointing and ``torch.compile`` wrapper parts removed as ``get_state_dict``
does. The name that comes first in the state dict is kept (the optimizer state is flattened under that same
name), the others are dropped before the write and recorded in the role manifest as ``tied_aliases``
(alias -> kept name). Every rank holds the same module structure, so every rank drops the same keys.

On load the alias keys are left out of what DCP reads and then pointed at the loaded tensor of the kept name,
so ``set_state_dict`` fills the parameter once and a model that is not tied gets the kept values under both
names.
Checkpoints written before this (no ``tied_aliases`` in the manifest) hold every name and load as they are.
Under FSDP1 without ``use_orig_params`` the module only shows flat parameters: nothing is found and every name
is written, as before.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _state_dict_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def tied_aliases(model: torch.nn.Module, keys: list[str]) -> dict[str, str]:
    """Alias -> kept name for every tensor of ``model`` that appears in ``keys`` under more than one name."""
    names_of: dict[int, list[str]] = {}
    tensors = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in tensors:
        names_of.setdefault(id(tensor), []).append(_state_dict_name(name))
    order = {key: i for i, key in enumerate(keys)}
    aliases: dict[str, str] = {}
    for names in names_of.values():
        present = sorted({n for n in names if n in order}, key=order.__getitem__)
        if len(present) > 1:
            aliases.update(dict.fromkeys(present[1:], present[0]))
    return aliases


def drop_aliases(model_state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``model_state`` without the alias keys (each alias's tensor is stored under its kept name)."""
    return {k: v for k, v in model_state.items() if k not in aliases}


def fill_aliases(model_state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``model_state`` with every alias whose kept name is present pointing at the kept name's tensor."""
    out = dict(model_state)
    for alias, kept in aliases.items():
        if kept in out:
            out[alias] = out[kept]
    return out
