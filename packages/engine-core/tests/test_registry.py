"""Registries: duplicates raise, unknown names list what exists, a backend's engine and config come together."""

from dataclasses import dataclass

import pytest

from posttrain.core.config import EngineConfig
from posttrain.core.registry import EngineRegistry, RolloutRegistry
from posttrain.core.rollout import RolloutConfig


@dataclass(kw_only=True)
class ToyEngineConfig(EngineConfig):
    """A third-party backend's config."""

    strategy: str | None = "toy"
    toy_knob: int = 3


@dataclass(kw_only=True)
class ToyRolloutConfig(RolloutConfig):
    """A third-party rollout's config."""

    name: str = "toy"
    toy_knob: int = 4


def test_duplicate_name_raises():
    reg = EngineRegistry({"language_model.fsdp2": "a.b:C"})
    reg.register("language_model.fsdp2", "a.b:C")  # the same target twice is one registration
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("language_model.fsdp2", "x.y:Z", source="other-dist")
    reg.configs.register("toy", "a:B")
    with pytest.raises(ValueError, match="posttrain.engine_configs: 'toy' is registered twice"):
        reg.configs.register("toy", "x.y:Other")


def test_unknown_engine_lists_available():
    reg = EngineRegistry({"language_model.fsdp2": "a.b:C"})
    with pytest.raises(
        ValueError,
        match=r"backend='megatron'. Installed engines: language_model.fsdp2. Install posttrain-engine-megatron \(pip install posttrain-engine-megatron",
    ):
        reg.get_engine_cls("language_model", "megatron")


def test_config_class_comes_from_the_config_group():
    reg = EngineRegistry(
        {"language_model.toy": "posttrain_no_such_module:Engine"},
        configs={"toy": "test_registry:ToyEngineConfig"},
    )
    assert reg.get_config_cls("toy") is ToyEngineConfig  # resolving the config imported no engine module
    with pytest.raises(
        ValueError,
        match=r"backend 'megatron' is not installed \(installed backends: toy\): install posttrain-engine-megatron",
    ):
        reg.get_config_cls("megatron")
    with pytest.raises(TypeError, match="not a EngineConfig subclass"):
        EngineRegistry(configs={"bad": "collections:OrderedDict"}).get_config_cls("bad")


def test_unknown_rollout_names_package():
    with pytest.raises(ValueError, match=r"posttrain-rollout-vllm"):
        RolloutRegistry({}).get_rollout_cls("vllm")
    with pytest.raises(
        ValueError,
        match=r"rollout 'vllm' is not installed \(installed rollouts: none\): install "
        r"posttrain-rollout-vllm",
    ):
        RolloutRegistry({}).get_config_cls("vllm")


def test_rollout_config_class_comes_from_the_config_group():
    reg = RolloutRegistry(
        {"toy": "posttrain_no_such_module:Rollout"}, configs={"toy": "test_registry:ToyRolloutConfig"}
    )
    assert reg.get_config_cls("toy") is ToyRolloutConfig  # resolving the config imported no rollout module
    with pytest.raises(TypeError, match="not a RolloutConfig subclass"):
        RolloutRegistry(configs={"bad": "test_registry:ToyEngineConfig"}).get_config_cls("bad")


def test_non_engine_target_rejected():
    reg = EngineRegistry({"language_model.x": "collections:OrderedDict"})
    with pytest.raises(TypeError, match="not a BaseEngine subclass"):
        reg.get_engine_cls("language_model", "x")


def test_lazy_import_on_first_use():
    reg = EngineRegistry({"language_model.ghost": "posttrain_no_such_module:Engine"})
    assert reg.names() == ["language_model.ghost"]  # building the registry imported nothing
    with pytest.raises(ModuleNotFoundError):
        reg.get_engine_cls("language_model", "ghost")
