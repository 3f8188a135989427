"""Config dataclasses owned by engine-core (engine, optimizer, checkpoint, model) and their shared rules."""

from .checkpoint import CheckpointConfig
from .engine import (
    EngineConfig,
    FSDPEngineConfig,
    McoreEngineConfig,
    QATConfig,
    RouterReplayConfig,
    engine_config_class,
)
from .model import ModelConfig
from .optim import OptimizerConfig
from .rules import check_checkpoint_for_engine

__all__ = [
    "CheckpointConfig",
    "EngineConfig",
    "FSDPEngineConfig",
    "McoreEngineConfig",
    "ModelConfig",
    "OptimizerConfig",
    "QATConfig",
    "RouterReplayConfig",
    "check_checkpoint_for_engine",
    "engine_config_class",
]
