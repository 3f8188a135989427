"""A name -> function table with a ``register`` decorator, a ``get`` that lists the known names, and per-name
traits: metadata the RL loop branches on (an advantage estimator's need for a critic, say), declared where the
function is registered instead of by name in the loop.

A registry knows its built-in names as data and the module that registers their functions, so a config can
check a name without importing torch; ``get`` and ``traits`` import that module the first time they run."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class FunctionRegistry(Generic[F]):
    """Functions of one kind (advantage estimators, policy losses, KL estimators) by name."""

    def __init__(
        self, kind: str, config_key: str, *, builtin: tuple[str, ...], module: str, default_traits: Any = None
    ) -> None:
        self.kind, self.config_key = kind, config_key
        self.builtin, self.module = builtin, module
        """Names ``module`` registers when imported (checked against it by the tests)."""
        self.default_traits = default_traits
        self.fns: dict[str, F] = {}
        self._traits: dict[str, Any] = {}

    def register(self, name: str, *aliases: str, traits: Any = None) -> Callable[[F], F]:
        """Decorator: file ``fn`` under ``name`` (and each alias) with ``traits`` (None: the registry's
        default); a name taken by another function raises."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self.fns and self.fns[key] is not fn:
                    raise ValueError(
                        f"{self.kind} {key!r} is already registered ({self.fns[key].__qualname__}): "
                        "pick another name"
                    )
                self.fns[key] = fn
                self._traits[key] = self.default_traits if traits is None else traits
            return fn

        return decorator

    def get(self, name: str) -> F:
        self._check(name)
        return self.fns[name]

    def traits(self, name: str) -> Any:
        """The traits ``name`` was registered with."""
        self._check(name)
        return self._traits[name]

    def _check(self, name: str) -> None:
        if name not in self:
            raise ValueError(
                f"unknown {self.kind} {name!r} ({self.config_key}): choose one of {self.names()}"
            )
        if name not in self.fns:
            importlib.import_module(self.module)

    def names(self) -> list[str]:
        """The built-in names and every registered one, sorted."""
        return sorted({*self.builtin, *self.fns})

    def __contains__(self, name: object) -> bool:
        return name in self.builtin or name in self.fns
