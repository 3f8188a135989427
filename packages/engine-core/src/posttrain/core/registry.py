"""Name -> class registries filled from entry points, imported on first use.

Engines are declared in the ``posttrain.engines`` group with names ``<model_type>.<backend>.<device>`` and
rollouts in ``posttrain.rollouts`` with their backend name; the value is ``module:Class``. Nothing registers at
import time: a registry reads the installed distributions' metadata when it is built, so a package that is not
installed is simply absent and asking for it says which package to install.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

ENGINE_GROUP = "posttrain.engines"
ROLLOUT_GROUP = "posttrain.rollouts"

ENGINE_PACKAGES = {
    "fsdp": "posttrain-engine-fsdp",
    "fsdp2": "posttrain-engine-fsdp",
    "megatron": "posttrain-engine-megatron (pip install 'posttrain[megatron]')",
}
ROLLOUT_PACKAGES = {
    "hf": "posttrain-rollout-hf",
    "vllm": "posttrain-rollout-vllm (pip install 'posttrain[vllm]')",
}


def runtime_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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


class EngineRegistry(_EntryPointRegistry):
    """(model_type, backend, device) -> engine class."""

    group = ENGINE_GROUP
    packages = ENGINE_PACKAGES

    def get_engine_cls(self, model_type: str, backend: str, device: str | None = None) -> type:
        device = device or runtime_device()
        from .engine import BaseEngine

        hint = self.packages.get(backend, f"a package that provides backend {backend!r}")
        missing = (
            f"no engine for model_type={model_type!r}, backend={backend!r}, device={device!r}. "
            f"Installed engines: {{have}}. Install {hint} or choose another backend."
        )
        return self._resolve(f"{model_type}.{backend}.{device}", BaseEngine, missing)

    def new(self, model_type: str, backend: str, *args: Any, device: str | None = None, **kwargs: Any) -> Any:
        return self.get_engine_cls(model_type, backend, device)(*args, **kwargs)


class RolloutRegistry(_EntryPointRegistry):
    """backend name -> rollout class."""

    group = ROLLOUT_GROUP
    packages = ROLLOUT_PACKAGES

    def get_rollout_cls(self, name: str) -> type:
        from .rollout import BaseRollout

        hint = self.packages.get(name, f"a package that provides rollout {name!r}")
        missing = (
            f"no rollout named {name!r}. Installed rollouts: {{have}}. Install {hint} or set "
            "rollout.name to one of those."
        )
        return self._resolve(name, BaseRollout, missing)
