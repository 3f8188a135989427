"""Name -> class registries filled from entry points, imported on first use.

A training backend declares two things: its engines in the ``posttrain.engines`` group, named
``<model_type>.<backend>`` (``language_model.fsdp2``), and its config dataclass in ``posttrain.engine_configs``,
named ``<backend>``. A rollout does the same: its class in ``posttrain.rollouts`` and its config dataclass (a
:class:`~posttrain.core.rollout.RolloutConfig` subclass) in ``posttrain.rollout_configs``, both under its rollout
name. The value is ``module:Class``. Nothing registers at import time: a registry reads the installed distributions' metadata when
it is built, so a backend that is not installed is simply absent and asking for it lists what is there. A
config module must import without its backend's heavy dependencies (the config of a megatron backend resolves
without megatron-core).
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import Any

ENGINE_GROUP = "posttrain.engines"
ENGINE_CONFIG_GROUP = "posttrain.engine_configs"
ROLLOUT_GROUP = "posttrain.rollouts"
ROLLOUT_CONFIG_GROUP = "posttrain.rollout_configs"

ROLLOUT_PACKAGES = {
    "hf": "posttrain-rollout-hf",
    "vllm": "posttrain-rollout-vllm (pip install 'posttrain[vllm]')",
}
ENGINE_PACKAGES = {
    "fsdp": "posttrain-engine-fsdp (pip install posttrain-engine-fsdp)",
    "fsdp2": "posttrain-engine-fsdp (pip install posttrain-engine-fsdp)",
    "megatron": "posttrain-engine-megatron (pip install posttrain-engine-megatron; docs/megatron-engine.md)",
}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class _EntryPointRegistry:
    group: str
    packages: dict[str, str]

    def __init__(self, targets: dict[str, str] | None = None) -> None:
        self._targets: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        for name, target in (targets or {}).items():
            self.register(name, target)

    @classmethod
    def from_entry_points(cls):
        reg = cls()
        for ep in entry_points(group=cls.group):
            dist = ep.dist.name if ep.dist is not None else "?"
            reg.register(ep.name, ep.value, source=dist)
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

    def _resolve(self, key: str, base: type, missing: str) -> type:
        """Import ``key``'s target and check it subclasses ``base``; ``missing`` is the error if unknown."""
        if key not in self._targets:
            raise ValueError(missing.format(have=", ".join(self.names()) or "none"))
        cls = _load(self._targets[key])
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{self._targets[key]} ({key}) is not a {base.__name__} subclass")
        return cls


class EngineConfigRegistry(_EntryPointRegistry):
    """backend name -> engine config dataclass (a subclass of :class:`~posttrain.core.config.EngineConfig`)."""

    group = ENGINE_CONFIG_GROUP

    def get_config_cls(self, backend: str) -> type:
        from .config.engine import EngineConfig

        hint = ENGINE_PACKAGES.get(
            backend, f"the package that registers {backend!r} in the {self.group} group"
        )
        missing = (
            f"engine backend {backend!r} is not installed (installed backends: {{have}}): install {hint}, "
            "or choose one of those"
        )
        return self._resolve(backend, EngineConfig, missing)


class _PairedRegistry(_EntryPointRegistry):
    """Classes registered together with their config dataclasses (:meth:`get_config_cls`)."""

    config_registry: type

    def __init__(self, targets: dict[str, str] | None = None, configs: dict[str, str] | None = None) -> None:
        super().__init__(targets)
        self.configs = self.config_registry(configs)

    @classmethod
    def from_entry_points(cls):
        reg = super().from_entry_points()
        reg.configs = cls.config_registry.from_entry_points()
        return reg

    def get_config_cls(self, name: str) -> type:
        return self.configs.get_config_cls(name)


class EngineRegistry(_PairedRegistry):
    """(model_type, backend) -> engine class; :meth:`get_config_cls` gives the backend's config class."""

    group = ENGINE_GROUP
    config_registry = EngineConfigRegistry

    def get_engine_cls(self, model_type: str, backend: str) -> type:
        from .engine import BaseEngine

        hint = ENGINE_PACKAGES.get(
            backend, f"the package that registers {model_type}.{backend} in the {self.group} group"
        )
        missing = (
            f"no engine for model_type={model_type!r}, backend={backend!r}. Installed engines: {{have}}. "
            f"Install {hint}, or choose another backend."
        )
        return self._resolve(f"{model_type}.{backend}", BaseEngine, missing)

    def new(self, model_type: str, backend: str, *args: Any, **kwargs: Any) -> Any:
        return self.get_engine_cls(model_type, backend)(*args, **kwargs)


@functools.cache
def _installed_engine_configs() -> EngineConfigRegistry:
    return EngineConfigRegistry.from_entry_points()


def engine_config_class(backend: str) -> type:
    """The config dataclass the installed backend ``backend`` registered, or a ValueError listing those there are."""
    return _installed_engine_configs().get_config_cls(backend)


class RolloutConfigRegistry(_EntryPointRegistry):
    """rollout name -> rollout config dataclass (a subclass of :class:`~posttrain.core.rollout.RolloutConfig`)."""

    group = ROLLOUT_CONFIG_GROUP
    packages = ROLLOUT_PACKAGES

    def get_config_cls(self, name: str) -> type:
        from .rollout import RolloutConfig

        hint = self.packages.get(name, f"the package that registers {name!r} in the {self.group} group")
        missing = f"rollout {name!r} is not installed (installed rollouts: {{have}}): install {hint}"
        return self._resolve(name, RolloutConfig, missing)


@functools.cache
def _installed_rollout_configs() -> RolloutConfigRegistry:
    return RolloutConfigRegistry.from_entry_points()


def rollout_config_class(name: str) -> type:
    """The config dataclass the installed rollout ``name`` registered, or a ValueError naming what to install."""
    return _installed_rollout_configs().get_config_cls(name)


def rollout_config_names() -> list[str]:
    """The rollouts whose config dataclass is installed."""
    return _installed_rollout_configs().names()


class RolloutRegistry(_PairedRegistry):
    """backend name -> rollout class; :meth:`get_config_cls` gives the rollout's config class."""

    group = ROLLOUT_GROUP
    packages = ROLLOUT_PACKAGES
    config_registry = RolloutConfigRegistry

    def get_rollout_cls(self, name: str) -> type:
        from .rollout import BaseRollout

        hint = self.packages.get(name, f"a package that provides rollout {name!r}")
        missing = (
            f"no rollout named {name!r}. Installed rollouts: {{have}}. Install {hint} or set "
            "rollout.name to one of those."
        )
        return self._resolve(name, BaseRollout, missing)
