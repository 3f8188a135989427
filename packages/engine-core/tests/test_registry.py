"""The one registry: duplicates raise, unknown names list what exists, a config class builds its
engine/rollout."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

from posttrain.core.config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig
from posttrain.core.engine import BaseEngine
from posttrain.core.registry import ENGINE_GROUP, ROLLOUT_GROUP, ConfigRegistry
from posttrain.core.rollout import RolloutConfig


class ToyEngine(BaseEngine):
    """Records what it was built with."""

    initialized = False

    def initialize(self) -> None:
        self.initialized = True


ToyEngine.__abstractmethods__ = (
    frozenset()
)  # built, never stepped: the contract's other methods are not called


@dataclass(kw_only=True)
class ToyEngineConfig(EngineConfig):
    """A third-party backend's config."""

    engines: ClassVar[dict[str, str]] = {"language_model": "test_registry:ToyEngine"}
    strategy: str | None = "toy"
    toy_knob: int = 3


@dataclass(kw_only=True)
class ToyRolloutConfig(RolloutConfig):
    """A third-party rollout's config."""

    name: str = "toy"
    toy_knob: int = 4


def test_duplicate_name_raises():
    reg = ConfigRegistry(ENGINE_GROUP, {"fsdp2": "a.b:C"})
    reg.register("fsdp2", "a.b:C")  # the same target twice is one registration
    with pytest.raises(ValueError, match="posttrain.engines: 'fsdp2' is registered twice"):
        reg.register("fsdp2", "x.y:Z", source="other-dist")


def test_unknown_name_lists_installed_and_the_package():
    reg = ConfigRegistry(ENGINE_GROUP, {"toy": "test_registry:ToyEngineConfig"})
    assert reg.config_class("toy") is ToyEngineConfig
    with pytest.raises(
        ValueError,
        match=r"'megatron' is not installed \(posttrain.engines: toy\): install posttrain-engine-megatron",
    ):
        reg.config_class("megatron")
    with pytest.raises(TypeError, match="not a EngineConfig subclass"):
        ConfigRegistry(ENGINE_GROUP, {"bad": "collections:OrderedDict"}).config_class("bad")
    with pytest.raises(
        ValueError,
        match=r"'vllm' is not installed \(posttrain.rollouts: none\): install posttrain-rollout-vllm",
    ):
        ConfigRegistry(ROLLOUT_GROUP).config_class("vllm")
    with pytest.raises(TypeError, match="not a RolloutConfig subclass"):
        ConfigRegistry(ROLLOUT_GROUP, {"bad": "test_registry:ToyEngineConfig"}).config_class("bad")


def test_config_builds_its_engine_initialised():
    cfg = ToyEngineConfig(toy_knob=5)
    engine = cfg.build(model=ModelConfig(), optim=OptimizerConfig(), ckpt=CheckpointConfig())
    assert type(engine) is ToyEngine and engine.initialized and engine.engine_config is cfg
    with pytest.raises(
        ValueError, match=r"ToyEngineConfig \(engine.strategy=toy\) builds no value_model engine"
    ):
        cfg.build("value_model", model=ModelConfig(), optim=OptimizerConfig(), ckpt=CheckpointConfig())


def test_plain_rollout_config_names_the_package_to_install():
    with pytest.raises(ValueError, match="rollout.name='vllm'.*install posttrain-rollout-vllm"):
        RolloutConfig(name="vllm").build("model-dir", device="cpu")


def test_lazy_import_on_first_use():
    reg = ConfigRegistry(ENGINE_GROUP, {"ghost": "posttrain_no_such_module:Config"})
    assert reg.names() == ["ghost"]  # building the registry imported nothing
    with pytest.raises(ModuleNotFoundError):
        reg.config_class("ghost")
