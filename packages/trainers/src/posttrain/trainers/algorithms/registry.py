"""A name -> function table with a ``register`` decorator and a ``get`` that lists the known names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class FunctionRegistry(Generic[F]):
    """Functions of one kind (advantage estimators, policy losses, KL estimators) by name."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind, self.config_key = kind, config_key
        self.fns: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator: file ``fn`` under ``name`` (and each alias); a name taken by another function raises."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self.fns and self.fns[key] is not fn:
                    raise ValueError(
                        f"{self.kind} {key!r} is already registered ({self.fns[key].__qualname__}): "
                        "pick another name"
                    )
                self.fns[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        if name not in self.fns:
            raise ValueError(
                f"unknown {self.kind} {name!r} ({self.config_key}): choose one of {self.names()}"
            )
        return self.fns[name]

    def names(self) -> list[str]:
        return sorted(self.fns)

    def __contains__(self, name: object) -> bool:
        return name in self.fns
