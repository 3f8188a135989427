"""posttrain engine-core: the contracts every other posttrain package builds on.

``BaseEngine`` and ``EngineRegistry`` (training backends), the packed-batch contract (``PackedBatch``,
micro-batching, ``LossContext``), config dataclasses, ``BaseRollout`` and the bucketed weight-sync protocol.
It imports no megatron, vLLM or Transformer Engine module.
"""

from .batch import LossContext, PackedBatch, loss_context, make_micro_batches, restore_order
from .engine import BaseEngine, EngineModeCtx
from .registry import EngineRegistry, RolloutRegistry
from .rollout import BaseRollout, RolloutConfig, RolloutSample, SamplingConfig, SyncReport

__all__ = [
    "BaseEngine",
    "BaseRollout",
    "EngineModeCtx",
    "EngineRegistry",
    "LossContext",
    "PackedBatch",
    "RolloutConfig",
    "RolloutRegistry",
    "RolloutSample",
    "SamplingConfig",
    "SyncReport",
    "loss_context",
    "make_micro_batches",
    "restore_order",
]
