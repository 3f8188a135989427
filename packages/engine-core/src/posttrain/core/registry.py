"""The one registry: a backend name -> its config class, read from entry points once, when a config is loaded.

A training backend registers one config class per name in the ``posttrain.engines`` group (``fsdp2 =
posttrain.fsdp.config:FSDP2EngineConfig``), a subclass of :class:`~posttrain.core.config.EngineConfig`; a
rollout registers its config class (a :class:`~posttrain.core.rollout.RolloutConfig` subclass) in
``posttrain.rollouts``.
The config class carries the rest: which engine (per model type) or rollout it builds, through its
``build(...)``, so nothing after the config loader looks a name up. Nothing registers at import time: the
groups are read from the installed distributions' metadata, so a backend that is not installed is simply
absent and asking for it lists what is there. A config module must import without its backend's heavy
dependencies (the megatron config resolves without megatron-core).
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import Any

ENGINE_GROUP = "posttrain.engines"
ROLLOUT_GROUP = "posttrain.rollouts"

PACKAGES = {
    ENGINE_GROUP: {
        "fsdp": "posttrain-engine-fsdp",
        "fsdp2": "posttrain-engine-fsdp",
        "megatron": "posttrain-engine-megatron (pip install 'posttrain[megatron]')",
        "torchtitan": "posttrain-engine-torchtitan (pip install 'posttrain[torchtitan]')",
    },
    ROLLOUT_GROUP: {
        "hf": "posttrain-rollout-hf",
        "vllm": "posttrain-rollout-vllm (pip install 'posttrain[vllm]')",
    },
}
ROLLOUT_PACKAGES = PACKAGES[ROLLOUT_GROUP]


def load_target(target: str) -> Any:
    """The object ``module:Attr.path`` names, imported now."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class ConfigRegistry:
    """name -> ``module:Class`` of a config class in one entry-point group; a name registered twice (with
    different targets) is refused with both sources named."""

    def __init__(self, group: str, targets: dict[str, str] | None = None) -> None:
        self.group = group
        self._targets: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        for name, target in (targets or {}).items():
            self.register(name, target)

    @classmethod
    def from_entry_points(cls, group: str) -> ConfigRegistry:
        reg = cls(group)
        for ep in entry_points(group=group):
            reg.register(ep.name, ep.value, source=ep.dist.name if ep.dist is not None else "?")
        return reg

    def register(self, name: str, target: str, source: str = "code") -> None:
        if name in self._targets and self._targets[name] != target:
            raise ValueError(
                f"{self.group}: {name!r} is registered twice ({self._targets[name]} from "
                f"{self._sources[name]} and {target} from {source}): uninstall one of them"
            )
        self._targets[name] = target
        self._sources[name] = source

    def names(self) -> list[str]:
        return sorted(self._targets)

    def source(self, name: str) -> str:
        """The distribution that registered ``name``."""
        return self._sources[name]

    def config_class(self, name: str) -> type:
        """Import ``name``'s config class and check its base; a ValueError listing what is installed if
        unknown."""
        from .config.engine import EngineConfig
        from .rollout import RolloutConfig

        base = EngineConfig if self.group == ENGINE_GROUP else RolloutConfig
        if name not in self._targets:
            hint = PACKAGES.get(self.group, {}).get(
                name, f"the package that registers {name!r} in {self.group}"
            )
            raise ValueError(
                f"{name!r} is not installed ({self.group}: {', '.join(self.names()) or 'none'}): install "
                f"{hint}, or choose one of those"
            )
        cls = load_target(self._targets[name])
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{self._targets[name]} ({self.group} {name}) is not a {base.__name__} subclass")
        return cls


@functools.cache
def installed(group: str) -> ConfigRegistry:
    """The registry of ``group`` as the installed distributions declare it (read once per process)."""
    return ConfigRegistry.from_entry_points(group)


def engine_config_class(backend: str) -> type:
    """The config class the installed backend ``backend`` registered, or a ValueError listing those there
    are."""
    return installed(ENGINE_GROUP).config_class(backend)


def rollout_config_class(name: str) -> type:
    """The config class the installed rollout ``name`` registered, or a ValueError naming what to install."""
    return installed(ROLLOUT_GROUP).config_class(name)


def rollout_config_names() -> list[str]:
    """The installed rollouts."""
    return installed(ROLLOUT_GROUP).names()
