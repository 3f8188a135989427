"""Imports of the optional heavy Megatron dependencies, each failing with an install hint.

Megatron-Bridge imports Transformer Engine unconditionally (its LoRA layers), so on a machine without
Transformer Engine the bridge cannot be imported at all; the error says what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TE_HINT = (
    "Megatron-Bridge imports Transformer Engine (transformer_engine.pytorch) unconditionally: install it "
    "with `pip install --no-build-isolation transformer_engine[pytorch]` (needs CUDA) on the machine that "
    "runs the megatron engine"
)


def has_transformer_engine() -> bool:
    """True when Megatron-Core found a working Transformer Engine (selects the TE layer spec)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def import_bridge() -> ModuleType:
    """``megatron.bridge``, or an ImportError naming what is missing and how to install it."""
    try:
        return importlib.import_module("megatron.bridge")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("transformer_engine"):
            raise ImportError(TE_HINT) from exc
        raise ImportError(
            f"Megatron-Bridge is not importable ({exc}): install posttrain-engine-megatron's "
            "dependencies with `pip install 'posttrain[megatron]'`"
        ) from exc


def import_vanilla_mbridge() -> ModuleType:
    """The deprecated standalone ``mbridge`` package (``engine.vanilla_mbridge=true``)."""
    try:
        return importlib.import_module("mbridge")
    except ModuleNotFoundError as exc:
        raise ImportError(
            "engine.vanilla_mbridge=true needs the deprecated `mbridge` package, which is not "
            "installed: `pip install 'posttrain-engine-megatron[mbridge]'` (mbridge 0.15.1), or set "
            "engine.vanilla_mbridge=false to use Megatron-Bridge"
        ) from exc
