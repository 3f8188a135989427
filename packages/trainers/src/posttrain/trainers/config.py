"""The whole run's config: one dataclass tree, YAML presets and ``key=value`` overrides.

Top-level keys: model, data, actor, ref, critic, rollout, algorithm, reward, trainer, checkpoint, plus ``model_engine``
(fsdp | fsdp2 | megatron | any installed backend), which sets the strategy of actor, ref and critic at once; a
per-role ``<role>.engine.strategy=...`` still wins. Each role's engine starts as the shared ``EngineConfig`` and
``PostTrainConfig.__post_init__`` turns it into its backend's config class, found through the
``posttrain.engine_configs`` entry points, so ``PostTrainConfig(model_engine="megatron")`` in Python and
``model_engine=megatron`` on the command line give the same tree. The loader builds its OmegaConf schema from
defaults whose engine classes match the backends the presets and overrides name (a schema has one class per
node). The rollout works the same way by ``rollout.name``: a plain ``RolloutConfig`` becomes the config class that
rollout registered in ``posttrain.rollout_configs`` (``VLLMRolloutConfig`` for ``vllm``), and the loader refuses,
before merging, a ``rollout.<key>`` that the named rollout does not declare (a vLLM key under ``rollout.name=hf``),
naming the rollout that does. Each component validates its own fields; this module adds the rules that span
components (checkpoint x engine, parallel layout x world size).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from posttrain.core.config import CheckpointConfig, EngineConfig, ModelConfig, engine_config_class
from posttrain.core.config.loader import ConfigError, merge_config, parse_overrides
from posttrain.core.registry import ROLLOUT_PACKAGES, rollout_config_class, rollout_config_names
from posttrain.core.rollout import RolloutConfig

from .algorithms import AlgorithmConfig
from .data.config import DataConfig
from .data.files import coerce_file_lists
from .rewards import RewardConfig
from .roles import ActorConfig, CriticConfig, RefConfig
from .trainer_config import TrainerConfig

ROLES = ("actor", "ref", "critic")
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(kw_only=True)
class PostTrainConfig:
    """Everything a run needs."""

    model_engine: str = "fsdp2"
    """Backend of every role whose ``engine.strategy`` is null: fsdp (FSDP1), fsdp2, megatron, or another
    installed backend."""
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
    """Generation backend: the fields every rollout shares, plus the named rollout's own (its registered config
    class, chosen by ``rollout.name``)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL-in-reward (PPO / GRPO)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function (rule-based by data_source, or a user function)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, logging and resume."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """What checkpoints hold."""

    def __post_init__(self) -> None:
        backend_config_class(self.model_engine, "model_engine")
        self.rollout = resolve_rollout(self.rollout)
        world = self.trainer.nnodes * self.trainer.n_gpus_per_node
        for role in ROLES:
            role_cfg = getattr(self, role)
            role_cfg.engine = resolve_engine(role_cfg.engine, self.model_engine, role)
            role_cfg.engine.check_checkpoint(self.checkpoint, role)
            role_cfg.engine.check_world_size(world)


ENGINE_HINT = (
    "posttrain's own backends are fsdp and fsdp2 (posttrain-engine-fsdp) and megatron "
    "(posttrain-engine-megatron: pip install 'posttrain[megatron]')"
)


def backend_config_class(backend: str, key: str) -> type[EngineConfig]:
    """The installed config class of ``backend``; a ValueError naming ``key`` and what to install otherwise."""
    try:
        return engine_config_class(backend)
    except ValueError as exc:
        raise ValueError(f"{key}={backend!r}: {exc}; {ENGINE_HINT}") from None


def resolve_engine(engine: EngineConfig, model_engine: str, role: str) -> EngineConfig:
    """``engine`` as its backend's config class. A plain ``EngineConfig`` (the role default) becomes the class of
    its ``strategy``, or of ``model_engine`` when that is null, keeping the shared fields it was given; a
    backend's own config class is kept as it is."""
    if type(engine) is not EngineConfig:
        return engine
    strategy = engine.strategy or model_engine
    key = f"{role}.engine.strategy" if engine.strategy else "model_engine"
    cls = backend_config_class(strategy, key)
    shared = {f.name: getattr(engine, f.name) for f in dataclasses.fields(EngineConfig)}
    return cls(**{**shared, "strategy": strategy})


def installed_rollout_config(name: str) -> type[RolloutConfig] | None:
    """The config class rollout ``name`` registered, or None when no installed package registers one (an SFT run
    needs no rollout; an RL trainer names the package to install when it builds the rollout)."""
    return rollout_config_class(name) if name in rollout_config_names() else None


def resolve_rollout(rollout: RolloutConfig) -> RolloutConfig:
    """``rollout`` as the config class its ``name`` registered: a plain ``RolloutConfig`` keeps its shared fields
    and takes that class's defaults; a rollout's own config class must be the one its name registered."""
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
                f"rollout.{key} is a key of the {' and '.join(owners)} rollout, and rollout.name={name!r} does not "
                f"read it: set rollout.name={owners[0]}, or drop rollout.{key}"
            )
        if cls is RolloutConfig and name not in rollout_config_names():
            hint = ROLLOUT_PACKAGES.get(name, f"the package that registers rollout {name!r}")
            raise ValueError(
                f"rollout.{key} is not a key every rollout shares, and rollout.name={name!r} is not installed: "
                f"install {hint} (it declares its own keys), or drop rollout.{key}"
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


def load_config(overrides: Sequence[str] = (), presets: Sequence[str] = ()) -> PostTrainConfig:
    """Defaults <- presets (in order) <- overrides, with each role's engine dataclass chosen by its backend."""
    preset_paths = [resolve_preset(p) for p in presets]
    dotlist = coerce_file_lists(parse_overrides(overrides))  # data.train_files=/x.parquet -> [/x.parquet]
    raw = OmegaConf.merge(*[OmegaConf.load(p) for p in preset_paths], dotlist)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the defaults are re-validated (and warn) after the merge
            schema = _schema_for(raw)
        return merge_config(schema, preset_paths, dotlist)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _schema_for(raw) -> PostTrainConfig:
    """Defaults whose engine classes are the backends ``raw`` names (its model_engine and role strategies), and
    whose rollout class is the one its ``rollout.name`` registered."""
    engines = {}
    for role in ROLES:
        strategy = OmegaConf.select(raw, f"{role}.engine.strategy", default=None)
        engines[role] = EngineConfig(
            strategy=None if strategy is None else str(strategy), forward_only=(role == "ref")
        )
    model_engine = OmegaConf.select(raw, "model_engine", default=None)
    rollout_name = str(OmegaConf.select(raw, "rollout.name", default=None) or RolloutConfig.name)
    rollout_cls = installed_rollout_config(rollout_name) or RolloutConfig
    check_rollout_keys(raw, rollout_cls, rollout_name)
    schema = PostTrainConfig(
        model_engine=str(model_engine or "fsdp2"),
        rollout=rollout_cls(name=rollout_name),
        actor=ActorConfig(engine=engines["actor"]),
        ref=RefConfig(engine=engines["ref"]),
        critic=CriticConfig(engine=engines["critic"]),
    )
    for role in ROLES:
        _restore_declared_defaults(getattr(schema, role).engine)
    return schema


def _restore_declared_defaults(engine: EngineConfig) -> None:
    """Undo what ``__post_init__`` adjusted on a default (megatron turns ``sequence_parallel`` off at TP=1), so
    the schema carries declared defaults and the merged values alone decide (TP=2 keeps it on)."""
    for spec in dataclasses.fields(engine):
        if spec.default is not dataclasses.MISSING and spec.name not in ("strategy", "forward_only"):
            setattr(engine, spec.name, spec.default)
