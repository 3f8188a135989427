"""transformers rollout for posttrain: the CPU default (``rollout.name=hf``).

``HFRollout`` generates in left-padded batches with a KV cache and takes weights through engine-core's
bucketed, checksummed weight-sync protocol. Its config (:mod:`.config`) imports without torch; the names below
are imported from their modules when first read.
"""

from typing import Any

_MODULE_OF = {"HFRollout": "rollout", "process_logits": "sampling", "select_tokens": "sampling"}
__all__ = ["HFRollout", "process_logits", "select_tokens"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
