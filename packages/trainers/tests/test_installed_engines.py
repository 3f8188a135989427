"""Every engine and rollout this venv installs (engine-fsdp and rollout-hf at least) is declared under a
well-formed name and loads a BaseEngine / BaseRollout subclass; every engine backend registers its config."""

from __future__ import annotations

from importlib.metadata import entry_points

from posttrain.core.config import EngineConfig
from posttrain.core.engine import BaseEngine
from posttrain.core.rollout import BaseRollout


def test_installed_engine_entry_points_load_engines():
    eps = list(entry_points(group="posttrain.engines"))
    names = {ep.name for ep in eps}
    assert {"language_model.fsdp2", "value_model.fsdp2"} <= names, names
    configs = {ep.name: ep for ep in entry_points(group="posttrain.engine_configs")}
    for ep in eps:
        model_type, backend = ep.name.split(".")
        assert model_type in ("language_model", "value_model"), ep.name
        cls = ep.load()
        assert isinstance(cls, type) and issubclass(cls, BaseEngine), ep
        assert backend in configs, (
            f"{ep.name}: backend {backend!r} registers no posttrain.engine_configs entry"
        )
        assert issubclass(configs[backend].load(), EngineConfig), configs[backend]


def test_installed_rollout_entry_points_load_rollouts():
    eps = list(entry_points(group="posttrain.rollouts"))
    assert "hf" in {ep.name for ep in eps}
    for ep in eps:
        cls = ep.load()
        assert isinstance(cls, type) and issubclass(cls, BaseRollout), ep
