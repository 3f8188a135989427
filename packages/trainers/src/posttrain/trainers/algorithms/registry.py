"""A name -> function table with a ``register`` decorator, a ``get`` that lists the known names, and per-name
traits: metadata the RL loop branches on (an advantage estimator's need for a critic, say), declared where the
function is registered instead of by name in the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class FunctionRegistry(Generic[F]):
    """Functions of one kind (advantage estimators, policy losses, KL estimators) by name."""

    def __init__(self, kind: str, config_key: str, default_traits: Any = None) -> None:
        self.kind, self.config_key = kind, config_key
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
        if name not in self.fns:
            raise ValueError(
                f"unknown {self.kind} {name!r} ({self.config_key}): choose one of {self.names()}"
            )

    def names(self) -> list[str]:
        return sorted(self.fns)

    def __contains__(self, name: object) -> bool:
        return name in self.fns
