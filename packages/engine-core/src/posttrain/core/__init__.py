"""posttrain engine-core: the contracts every other posttrain package builds on.

``BaseEngine`` (training backends; each backend's config class, registered in the ``posttrain.engines`` entry
points, builds its engine), the packed-batch contract (``PackedBatch``, micro-batching, ``LossContext``),
config dataclasses, ``BaseRollout`` and the bucketed weight-sync protocol. It imports no megatron, vLLM or
Transformer Engine module. The names below are imported from their modules on first use, so that
``posttrain.core.config`` (the config tree, ``posttrain config show``) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BaseEngine": "engine",
    "EngineModeCtx": "engine",
    "LossContext": "batch",
    "PackedBatch": "batch",
    "loss_context": "batch",
    "make_micro_batches": "batch",
    "restore_order": "batch",
    "BaseRollout": "rollout",
    "RolloutConfig": "rollout",
    "RolloutSample": "rollout",
    "SamplingConfig": "rollout",
    "SyncReport": "rollout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain.core' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
