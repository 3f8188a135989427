"""Imports of the optional heavy Megatron dependencies, each failing with an install hint.

Megatron-Bridge imports Transformer Engine unconditionally (its LoRA layers), so on a machine without
Transformer Engine the bridge cannot be imported at all; the error says what to install.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

TE_HINT = (
    "Megatron-Bridge imports Transformer Engine (transformer_engine.pytorch) unconditionally: install it on "
    "the machine that runs the megatron engine, for a CUDA 13 torch with the CUDA toolkit: `pip install "
    "--no-build-isolation 'transformer_engine[core_cu13,pytorch]==2.20.2'` (core_cu12 for CUDA 12; "
    "docs/megatron-engine.md, Installing Transformer Engine)"
)


def has_transformer_engine() -> bool:
    """True when Megatron-Core found a working Transformer Engine (selects the TE layer spec)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def has_apex_wgrad_fusion() -> bool:
    """True when APEX's ``fused_weight_gradient_mlp_cuda`` extension is importable.

    Megatron-Core's own linear layers (the output layer is one even on the TE spec) refuse
    ``gradient_accumulation_fusion`` without it; NGC containers ship it, a pip install of APEX without
    ``--cuda_ext`` does not."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


BRIDGE_MIN = "0.6.2"
BRIDGE_HINT = (
    "posttrain-engine-megatron expects Megatron-Bridge >= {min} in place (it is a prerequisite, not a "
    "dependency): install it from source or `pip install --no-deps megatron-bridge=={min}` into a Megatron "
    "stack, or in an environment without one `uv pip install --overrides overrides.txt "
    "'posttrain-engine-megatron[bridge]'` (docs/megatron-engine.md, Installing)"
)


def check_bridge_version(version: str) -> None:
    """ImportError when an installed Megatron-Bridge ``version`` is older than :data:`BRIDGE_MIN`."""
    from packaging.version import Version

    if Version(version) < Version(BRIDGE_MIN):
        raise ImportError(f"Megatron-Bridge {version} is installed; " + BRIDGE_HINT.format(min=BRIDGE_MIN))


def import_bridge() -> ModuleType:
    """``megatron.bridge``, or an ImportError naming what is missing and how to install it."""
    try:
        module = importlib.import_module("megatron.bridge")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("transformer_engine"):
            raise ImportError(TE_HINT) from exc
        raise ImportError(
            f"Megatron-Bridge is not importable ({exc}): " + BRIDGE_HINT.format(min=BRIDGE_MIN)
        ) from exc
    try:
        check_bridge_version(importlib.metadata.version("megatron-bridge"))
    except importlib.metadata.PackageNotFoundError:
        pass  # a source tree on PYTHONPATH carries no distribution metadata
    return module


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
