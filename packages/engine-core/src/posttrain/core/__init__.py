"""posttrain engine-core: the contracts every other posttrain package builds on.

``BaseEngine`` (training backends; each backend's config class, registered in the ``posttrain.engines`` entry
points, builds its engine), the packed-batch contract (``PackedBatch``,
micro-batching, ``LossContext``), config dataclasses, ``BaseRollout`` and the bucketed weight-sync protocol.
It imports no megatron, vLLM or Transformer Engine module.
"""

from .batch import LossContext, PackedBatch, loss_context, make_micro_batches, restore_order
from .engine import BaseEngine, EngineModeCtx
from .rollout import BaseRollout, RolloutConfig, RolloutSample, SamplingConfig, SyncReport

__all__ = [
    "BaseEngine",
    "BaseRollout",
    "EngineModeCtx",
    "LossContext",
    "PackedBatch",
    "RolloutConfig",
    "RolloutSample",
    "SamplingConfig",
    "SyncReport",
    "loss_context",
    "make_micro_batches",
    "restore_order",
]
