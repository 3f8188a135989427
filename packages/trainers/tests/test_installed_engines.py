"""Every engine and rollout this venv installs (engine-fsdp and rollout-hf at least) is one entry point whose
config class builds what it names: an engine config names a BaseEngine subclass per model type, a rollout
config a BaseRollout subclass."""

from __future__ import annotations

from importlib.metadata import entry_points

from posttrain.core.config import EngineConfig
from posttrain.core.engine import BaseEngine
from posttrain.core.registry import load_target
from posttrain.core.rollout import BaseRollout, RolloutConfig


def test_installed_engine_entry_points_name_config_classes_that_build_engines():
    eps = list(entry_points(group="posttrain.engines"))
    assert {"fsdp", "fsdp2"} <= {ep.name for ep in eps}
    for ep in eps:
        config = ep.load()
        assert isinstance(config, type) and issubclass(config, EngineConfig), ep
        assert config.engines and config().strategy == ep.name, ep
        for model_type, target in config.engines.items():
            assert model_type in ("language_model", "value_model"), ep
            assert issubclass(load_target(target), BaseEngine), target


def test_installed_rollout_entry_points_name_config_classes_that_build_rollouts():
    eps = list(entry_points(group="posttrain.rollouts"))
    assert "hf" in {ep.name for ep in eps}
    for ep in eps:
        config = ep.load()
        assert isinstance(config, type) and issubclass(config, RolloutConfig) and config().name == ep.name, ep
        assert issubclass(load_target(config.rollout_class), BaseRollout), ep
