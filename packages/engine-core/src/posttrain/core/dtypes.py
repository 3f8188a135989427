"""The one table of dtype spellings: every config dtype (engine, rollout, export) is parsed here.

Accepted: the torch names ``bfloat16``, ``float16``, ``float32``, the aliases ``bf16``, ``fp16``, ``half``,
``fp32``, ``float`` (any case), and ``torch.dtype`` values of those three types. Anything else is a
``ValueError`` that names the value and the choices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NAMES = ("bfloat16", "float16", "float32")
"""Canonical names (torch's); ``DTYPES`` maps each to its torch dtype (imported on first use: the config tree
validates dtypes without torch)."""
ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
"""Other spellings -> canonical name."""


def dtype_name(value: str | torch.dtype, key: str = "dtype") -> str:
    """The canonical name (``bfloat16``, ``float16`` or ``float32``) of ``value``; ``key`` names the config
    key in the error."""
    text = value.strip().lower() if isinstance(value, str) else str(value).removeprefix("torch.")
    name = ALIASES.get(text, text)
    if name not in NAMES:
        choices = ", ".join([*NAMES, *ALIASES])
        raise ValueError(f"{key}={value!r} is not a supported dtype: use one of {choices}")
    return name


def parse_dtype(value: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """The torch dtype of ``value`` (see the module docstring); ``key`` names the config key in the error."""
    import torch

    return getattr(torch, dtype_name(value, key))


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in NAMES}
    raise AttributeError(f"module 'posttrain.core.dtypes' has no attribute {name!r}")
