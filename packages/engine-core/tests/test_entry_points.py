"""Registries built from installed distributions' entry points: a distribution written here (dist-info metadata
plus a module, on sys.path) is found, its engine and rollout import on first use, and two distributions that
claim one name are refused with both named. (engine-core's own venv has no engine installed; the installed
engines are checked in the trainers' tests.)"""

from __future__ import annotations

import sys
import textwrap

import pytest

from posttrain.core.engine import BaseEngine
from posttrain.core.registry import EngineRegistry, RolloutRegistry
from posttrain.core.rollout import BaseRollout, RolloutConfig

MODULE = "posttrain_test_plugin_mod"


def _distribution(root, name: str, entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(
        "from dataclasses import dataclass\n"
        "from posttrain.core.config import EngineConfig\n"
        "from posttrain.core.engine import BaseEngine\n"
        "from posttrain.core.rollout import BaseRollout\n"
        "class Engine(BaseEngine):\n    pass\n"
        "@dataclass(kw_only=True)\nclass Config(EngineConfig):\n    knob: int = 1\n"
        "class Rollout(BaseRollout):\n    pass\n"
        "from posttrain.core.rollout import RolloutConfig\n"
        "@dataclass(kw_only=True)\nclass RolloutKnobs(RolloutConfig):\n    name: str = 'testrollout'\n"
        "    rollout_knob: int = 2\n"
    )
    _distribution(
        tmp_path,
        "posttrain-test-plugin",
        f"""
        [posttrain.engines]
        language_model.testbackend = {MODULE}:Engine
        [posttrain.engine_configs]
        testbackend = {MODULE}:Config
        [posttrain.rollouts]
        testrollout = {MODULE}:Rollout
        [posttrain.rollout_configs]
        testrollout = {MODULE}:RolloutKnobs
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return tmp_path


def test_installed_distribution_engine_is_found_and_imported_on_first_use(plugin):
    reg = EngineRegistry.from_entry_points()
    assert "language_model.testbackend" in reg.names()
    assert MODULE not in sys.modules  # reading the metadata imported nothing
    cls = reg.get_engine_cls("language_model", "testbackend")
    assert issubclass(cls, BaseEngine) and cls.__module__ == MODULE and cls.__name__ == "Engine"
    config = reg.get_config_cls("testbackend")  # a third-party backend hands out its config with its engine
    assert config.__name__ == "Config" and config().knob == 1


def test_installed_distribution_rollout_is_found(plugin):
    reg = RolloutRegistry.from_entry_points()
    cls = reg.get_rollout_cls("testrollout")
    assert issubclass(cls, BaseRollout) and cls.__module__ == MODULE
    config = reg.get_config_cls("testrollout")  # a third-party rollout hands out its config with its class
    assert issubclass(config, RolloutConfig) and config().rollout_knob == 2


def test_two_distributions_claiming_one_name_are_refused(plugin):
    _distribution(
        plugin,
        "posttrain-other-plugin",
        """
        [posttrain.engines]
        language_model.testbackend = elsewhere:Engine
        """,
    )
    with pytest.raises(
        ValueError, match=r"registered twice.*posttrain-(test|other)-plugin.*posttrain-(test|other)-plugin"
    ):
        EngineRegistry.from_entry_points()
