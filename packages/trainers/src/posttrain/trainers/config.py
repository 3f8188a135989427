"""The whole run's config: one dataclass tree, YAML presets and ``key=value`` overrides.

Top-level keys: model, data, actor, ref, critic, rollout, algorithm, reward, trainer, checkpoint, plus ``model_engine``
(fsdp | fsdp2 | megatron), which sets the strategy of actor, ref and critic at once; a per-role
``<role>.engine.strategy=...`` still wins. Each component validates its own fields; this module adds the rules
that span components (checkpoint x engine, parallel layout x world size).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from posttrain.core.config import (
    CheckpointConfig,
    McoreEngineConfig,
    ModelConfig,
    check_checkpoint_for_engine,
    engine_config_class,
)
from posttrain.core.config.loader import ConfigError, merge_config, parse_overrides
from posttrain.core.rollout import RolloutConfig

from .algorithms import AlgorithmConfig
from .data.config import DataConfig
from .rewards import RewardConfig
from .roles import ActorConfig, CriticConfig, RefConfig
from .trainer_config import TrainerConfig

ROLES = ("actor", "ref", "critic")
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(kw_only=True)
class PostTrainConfig:
    """Everything a run needs."""

    model_engine: str = "fsdp2"
    """Backend of actor, ref and critic: fsdp (FSDP1), fsdp2 or megatron."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation backend."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL-in-reward (PPO / GRPO)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function (rule-based by data_source, or a user function)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, logging and resume."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What checkpoints hold."""

    def __post_init__(self) -> None:
        engine_config_class(self.model_engine)
        world = self.trainer.nnodes * self.trainer.n_gpus_per_node
        for role in ROLES:
            engine = getattr(self, role).engine
            check_checkpoint_for_engine(engine, self.checkpoint, role)
            if isinstance(engine, McoreEngineConfig):
                engine.check_world_size(world)


def resolve_preset(name: str) -> Path:
    """A preset name (``sft_tiny``) or a YAML path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = PRESET_DIR / f"{name}.yaml"
    if candidate.is_file():
        return candidate
    have = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
    raise ConfigError(f"config preset {name!r} is neither a YAML file nor a built-in preset ({have})")


def _role_strategy(raw, role: str, default: str) -> str:
    value = OmegaConf.select(raw, f"{role}.engine.strategy", default=None)
    return str(value) if value is not None else default


def load_config(overrides: Sequence[str] = (), presets: Sequence[str] = ()) -> PostTrainConfig:
    """Defaults <- presets (in order) <- overrides, with each role's engine dataclass chosen by its strategy."""
    preset_paths = [resolve_preset(p) for p in presets]
    dotlist = parse_overrides(overrides)
    raw = OmegaConf.merge(*[OmegaConf.load(p) for p in preset_paths], dotlist)
    model_engine = str(OmegaConf.select(raw, "model_engine", default=None) or "fsdp2")
    try:
        engine_config_class(model_engine)
    except ValueError as exc:
        raise ConfigError(f"model_engine={model_engine!r}: {exc}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the defaults are re-validated (and warn) after the merge
        defaults = _defaults_for(raw, model_engine)
    try:
        return merge_config(defaults, preset_paths, dotlist)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _defaults_for(raw, model_engine: str) -> PostTrainConfig:
    defaults = PostTrainConfig()
    for role in ROLES:
        strategy = _role_strategy(raw, role, model_engine)
        try:
            engine_cls = engine_config_class(strategy)
        except ValueError as exc:
            raise ConfigError(f"{role}.engine.strategy: {exc}") from None
        getattr(defaults, role).engine = engine_cls(strategy=strategy, forward_only=(role == "ref"))
    return defaults
