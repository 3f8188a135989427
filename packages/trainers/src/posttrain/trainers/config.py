"""The run's config: one dataclass tree per command, YAML presets and ``key=value`` overrides.

:class:`SFTConfig` (``posttrain sft``) holds model, data, actor (engine + optimizer), trainer and checkpoint;
:class:`PostTrainConfig` (``posttrain ppo`` / ``grpo``) adds ref, critic, rollout, algorithm, reward and the
RL trainer keys (``trainer.mode``...). Both take ``model_engine`` (fsdp | fsdp2 | megatron | any installed
backend):
the backend of every role whose ``<role>.engine.strategy`` is null.

Backend names are resolved once, here, when a config is loaded: :func:`schema_for` reads ``model_engine``,
each role's ``engine.strategy`` and ``rollout.name`` from the merged presets and overrides and puts, through
the one registry (:mod:`posttrain.core.registry`), the named config class at each node of the schema (declared
defaults, no ``__post_init__`` run); the merge then builds every dataclass once. After that the tree holds
typed configs whose ``build(...)`` returns the engine or rollout: nothing downstream reads a backend name.
Built in Python, ``PostTrainConfig(model_engine="megatron")`` turns each plain ``EngineConfig`` into its
backend's class the same way (:func:`resolve_engine`). The loader refuses, before merging, a ``rollout.<key>``
that the named rollout does not declare (a vLLM key under ``rollout.name=hf``), naming the rollout that does.
Each component validates its own fields; the roots add the rules that span components (checkpoint x engine,
parallel layout x world size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf

from posttrain.core.config import CheckpointConfig, EngineConfig, ModelConfig, engine_config_class
from posttrain.core.config.loader import ConfigError, merge_config, parse_overrides
from posttrain.core.registry import ROLLOUT_PACKAGES, rollout_config_class, rollout_config_names
from posttrain.core.rollout import RolloutConfig

from .agents.config import AgentConfig
from .algorithms import AlgorithmConfig
from .data.config import DataConfig
from .data.files import coerce_file_lists
from .rewards import RewardConfig
from .roles import ActorConfig, CriticConfig, RefConfig, SFTActorConfig
from .trainer_config import RLTrainerConfig, TrainerConfig

ROLES = ("actor", "ref", "critic")
PRESET_DIR = Path(__file__).parent / "presets"
COMMAND_PRESETS = {"ppo": [], "grpo": ["grpo"]}
"""Presets each RL command puts under the user's ``--config`` presets (``posttrain grpo``: ``grpo``)."""


@dataclass(kw_only=True)
class SFTConfig:
    """Everything an SFT run needs (``posttrain sft``)."""

    roles: ClassVar[tuple[str, ...]] = ("actor",)
    """The nodes that hold an ``engine`` config."""

    model_engine: str = "fsdp2"
    """Backend of every role whose ``engine.strategy`` is null: fsdp (FSDP1), fsdp2, megatron, or another
    installed backend."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    actor: SFTActorConfig = field(default_factory=SFTActorConfig)
    """The trained model: its engine and optimizer."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, logging and resume."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What checkpoints hold."""

    def __post_init__(self) -> None:
        backend_config_class(self.model_engine, "model_engine")
        world = self.trainer.nnodes * self.trainer.n_gpus_per_node
        for role in self.roles:
            role_cfg = getattr(self, role)
            role_cfg.engine = resolve_engine(role_cfg.engine, self.model_engine, role)
            role_cfg.engine.check_checkpoint(self.checkpoint, role)
            role_cfg.engine.check_world_size(world)


@dataclass(kw_only=True)
class PostTrainConfig(SFTConfig):
    """Everything an RL run needs (``posttrain ppo`` / ``posttrain grpo``)."""

    roles: ClassVar[tuple[str, ...]] = ROLES

    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation backend: the fields every rollout shares, plus the named rollout's own (its registered
    config class, chosen by ``rollout.name``)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL-in-reward (PPO / GRPO)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function (rule-based by data_source, or a user function)."""
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)
    """Loop, logging, resume, and how the rollout interleaves with training."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with an environment and tools (PPO / GRPO; off unless ``agent.env`` is set)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rollout = resolve_rollout(self.rollout)
        self.trainer.check_agent(self.agent)
        self.agent.check_rollout(self.rollout)


ENGINE_HINT = (
    "posttrain's own backends are fsdp and fsdp2 (posttrain-engine-fsdp) and megatron "
    "(posttrain-engine-megatron: pip install 'posttrain[megatron]')"
)


def backend_config_class(backend: str, key: str) -> type[EngineConfig]:
    """The installed config class of ``backend``; a ValueError naming ``key`` and what to install
    otherwise."""
    try:
        return engine_config_class(backend)
    except ValueError as exc:
        raise ValueError(f"{key}={backend!r}: {exc}; {ENGINE_HINT}") from None


def resolve_engine(engine: EngineConfig, model_engine: str, role: str) -> EngineConfig:
    """``engine`` as its backend's config class. A plain ``EngineConfig`` (the role default) becomes the class
    of its ``strategy``, or of ``model_engine`` when that is null, keeping the shared fields it was given; a
    backend's own config class is kept as it is."""
    if type(engine) is not EngineConfig:
        return engine
    strategy = engine.strategy or model_engine
    key = f"{role}.engine.strategy" if engine.strategy else "model_engine"
    cls = backend_config_class(strategy, key)
    shared = {f.name: getattr(engine, f.name) for f in dataclasses.fields(EngineConfig)}
    return cls(**{**shared, "strategy": strategy})


def installed_rollout_config(name: str) -> type[RolloutConfig] | None:
    """The config class rollout ``name`` registered, or None when no installed package registers one (an SFT
    run needs no rollout; an RL trainer names the package to install when it builds the rollout)."""
    return rollout_config_class(name) if name in rollout_config_names() else None


def resolve_rollout(rollout: RolloutConfig) -> RolloutConfig:
    """``rollout`` as the config class its ``name`` registered: a plain ``RolloutConfig`` keeps its shared
    fields and takes that class's defaults; a rollout's own config class must be the one its name
    registered."""
    cls = installed_rollout_config(rollout.name)
    if cls is None:
        if type(rollout) is not RolloutConfig:
            raise ValueError(
                f"rollout.name={rollout.name!r} names no installed rollout, but the config is a "
                f"{type(rollout).__name__}: set rollout.name to the rollout it configures"
            )
        return rollout
    if type(rollout) is RolloutConfig:
        return dataclasses.replace(cls.of(rollout), name=rollout.name)
    if not isinstance(rollout, cls):
        raise ValueError(
            f"rollout.name={rollout.name!r} is configured by {cls.__name__}, not {type(rollout).__name__}: "
            f"build a {cls.__name__} or set rollout.name to the rollout a {type(rollout).__name__} configures"
        )
    return rollout


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def check_rollout_keys(raw: DictConfig, cls: type[RolloutConfig], name: str) -> None:
    """Refuse a ``rollout.<key>`` that rollout ``name`` (configured by ``cls``) does not declare but another
    installed rollout does, or any key beyond the shared ones when ``name`` is not installed; a key no rollout
    declares is left to the loader's unknown-key error."""
    node = OmegaConf.select(raw, "rollout", default=None)
    declared = _field_names(cls)
    extra = [k for k in node.keys() if k not in declared] if isinstance(node, DictConfig) else []
    for key in extra:
        owners = [n for n in rollout_config_names() if key in _field_names(rollout_config_class(n))]
        if owners:
            raise ValueError(
                f"rollout.{key} is a key of the {' and '.join(owners)} rollout, and rollout.name={name!r} "
                f"does not read it: set rollout.name={owners[0]}, or drop rollout.{key}"
            )
        if cls is RolloutConfig and name not in rollout_config_names():
            hint = ROLLOUT_PACKAGES.get(name, f"the package that registers rollout {name!r}")
            raise ValueError(
                f"rollout.{key} is not a key every rollout shares, and rollout.name={name!r} is not "
                f"installed: install {hint} (it declares its own keys), or drop rollout.{key}"
            )


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


def load_config(
    overrides: Sequence[str] = (), presets: Sequence[str] = (), root: type[SFTConfig] = PostTrainConfig
) -> SFTConfig:
    """Defaults <- presets (in order) <- overrides, as a ``root`` tree (the RL one unless told), with each
    role's engine and the rollout configured by the classes their names registered."""
    preset_paths = [resolve_preset(p) for p in presets]
    dotlist = coerce_file_lists(parse_overrides(overrides))  # data.train_files=/x.parquet -> [/x.parquet]
    raw = OmegaConf.merge(*[OmegaConf.load(p) for p in preset_paths], dotlist)
    try:
        return merge_config(schema_for(raw, root), preset_paths, dotlist)
    except ConfigError as exc:
        raise ConfigError(_rl_only_hint(str(exc), raw, root)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _rl_only_hint(message: str, raw: DictConfig, root: type[SFTConfig]) -> str:
    """``message``, told that its unknown key is an RL key when ``root`` is the SFT tree and the RL tree has
    it."""
    key = message.split("'")[1] if message.startswith("unknown config key '") else ""
    if not key or root is PostTrainConfig:
        return message
    rl = OmegaConf.structured(PostTrainConfig)
    if OmegaConf.select(rl, key, default="<missing>") == "<missing>":
        return message
    return (
        f"{key} is a key of the RL trainers (posttrain ppo / grpo): posttrain sft has no rollout, reference, "
        f"critic or RL loop; drop {key}"
    )


def schema_for(raw: DictConfig, root: type[SFTConfig] = PostTrainConfig) -> DictConfig:
    """``root``'s schema (declared defaults) whose engine nodes are the config classes of the backends ``raw``
    names (its ``model_engine``, else each role's ``engine.strategy``) and whose rollout node is the class its
    ``rollout.name`` registered: the one place a backend name is read."""
    schema = OmegaConf.structured(root)
    model_engine = str(OmegaConf.select(raw, "model_engine", default=None) or schema.model_engine)
    for role in root.roles:
        strategy = OmegaConf.select(raw, f"{role}.engine.strategy", default=None)
        key = f"{role}.engine.strategy" if strategy else "model_engine"
        engine = OmegaConf.structured(backend_config_class(str(strategy or model_engine), key))
        engine.forward_only = bool(schema[role].engine.forward_only)
        schema[role].engine = engine
    if "rollout" in schema:
        name = str(OmegaConf.select(raw, "rollout.name", default=None) or schema.rollout.name)
        cls = installed_rollout_config(name) or RolloutConfig
        check_rollout_keys(raw, cls, name)
        schema.rollout = OmegaConf.structured(cls)
        schema.rollout.name = name
    return schema
