"""Registries built from installed distributions' entry points: a distribution written here (dist-info
metadata plus a module, on sys.path) is found, its config class imports on first use and builds its engine or
rollout, and two distributions that claim one name are refused with both named. (engine-core's own venv has no
engine installed; the installed engines are checked in the trainers' tests.)"""

from __future__ import annotations

import sys
import textwrap

import pytest

from posttrain.core.engine import BaseEngine
from posttrain.core.registry import ENGINE_GROUP, ROLLOUT_GROUP, ConfigRegistry
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
        "from dataclasses import dataclass\nfrom typing import ClassVar\n"
        "from posttrain.core.config import EngineConfig\n"
        "from posttrain.core.engine import BaseEngine\n"
        "from posttrain.core.rollout import BaseRollout\n"
        "class Engine(BaseEngine):\n    pass\n"
        "@dataclass(kw_only=True)\nclass Config(EngineConfig):\n"
        f"    engines: ClassVar[dict] = {{'language_model': '{MODULE}:Engine'}}\n    knob: int = 1\n"
        "class Rollout(BaseRollout):\n    def __init__(self, config, model, device, deterministic):\n"
        "        self.config, self.model = config, model\n"
        "    generate = update_weights = None\n"
        "from posttrain.core.rollout import RolloutConfig\n"
        "@dataclass(kw_only=True)\nclass RolloutKnobs(RolloutConfig):\n"
        f"    rollout_class: ClassVar[str] = '{MODULE}:Rollout'\n    name: str = 'testrollout'\n"
        "    rollout_knob: int = 2\n"
    )
    _distribution(
        tmp_path,
        "posttrain-test-plugin",
        f"""
        [posttrain.engines]
        testbackend = {MODULE}:Config
        [posttrain.rollouts]
        testrollout = {MODULE}:RolloutKnobs
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return tmp_path


def test_installed_distribution_engine_is_found_and_imported_on_first_use(plugin):
    reg = ConfigRegistry.from_entry_points(ENGINE_GROUP)
    assert "testbackend" in reg.names() and reg.source("testbackend") == "posttrain-test-plugin"
    assert MODULE not in sys.modules  # reading the metadata imported nothing
    config = reg.config_class("testbackend")
    assert config.__name__ == "Config" and config().knob == 1
    cls = config().engine_class("language_model")  # the config class names its engine
    assert issubclass(cls, BaseEngine) and cls.__module__ == MODULE and cls.__name__ == "Engine"


def test_installed_distribution_rollout_is_found_and_built(plugin):
    config = ConfigRegistry.from_entry_points(ROLLOUT_GROUP).config_class("testrollout")
    assert issubclass(config, RolloutConfig) and config().rollout_knob == 2
    rollout = config().build("some-dir", device="cpu")
    assert (
        isinstance(rollout, BaseRollout)
        and type(rollout).__module__ == MODULE
        and rollout.model == "some-dir"
    )


def test_two_distributions_claiming_one_name_are_refused(plugin):
    _distribution(
        plugin,
        "posttrain-other-plugin",
        """
        [posttrain.engines]
        testbackend = elsewhere:Config
        """,
    )
    with pytest.raises(
        ValueError, match=r"registered twice.*posttrain-(test|other)-plugin.*posttrain-(test|other)-plugin"
    ):
        ConfigRegistry.from_entry_points(ENGINE_GROUP)
