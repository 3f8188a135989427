"""Config dataclasses owned by engine-core: the shared engine base, optimizer, checkpoint and model.

Each backend's engine config subclasses :class:`EngineConfig` in the backend's package and is found by name
through :func:`engine_config_class` (the ``posttrain.engines`` entry points).
"""

from ..registry import engine_config_class
from .checkpoint import CheckpointConfig
from .engine import EngineConfig, RouterReplayConfig, normalize_dtype
from .model import ModelConfig
from .optim import OptimizerConfig

__all__ = [
    "CheckpointConfig",
    "EngineConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RouterReplayConfig",
    "engine_config_class",
    "normalize_dtype",
]
