"""Merge a dataclass tree with YAML presets and ``key=value`` overrides through OmegaConf.

The dataclasses are the schema: OmegaConf rejects unknown keys and badly typed values, then
``OmegaConf.to_object`` builds the dataclasses again so each ``__post_init__`` validates its own fields. Every
failure becomes one :class:`ConfigError` line that names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is wrong; the message says which and what is allowed."""


def _allowed_keys(schema: DictConfig, full_key: str) -> list[str]:
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    node = OmegaConf.select(schema, parent) if parent else schema
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _one_line(exc: OmegaConfBaseException, schema: DictConfig) -> str:
    full_key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        allowed = _allowed_keys(schema, full_key)
        return f"unknown config key {full_key!r}: allowed keys there are {', '.join(allowed)}"
    if isinstance(exc, ValidationError):
        return f"bad value for {full_key!r}: {msg}"
    return f"config error at {full_key!r}: {msg}" if full_key else f"config error: {msg}"


def check_known(layer: DictConfig, source: str = "override") -> None:
    """Refuse a key of ``layer`` that posttrain knows as verl's, renamed or removed, naming what to write
    (:mod:`.migrations`); keys it does not know are left to the merge's unknown-key error."""
    from .migrations import leaf_keys, migration_hint

    for key in leaf_keys(layer):
        hint = migration_hint(key)
        if hint:
            raise ConfigError(hint if source == "override" else f"{source}: {hint}")


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """Parse ``a.b=c`` strings (values in YAML syntax: ``[x,y]``, ``true``, ``null``); a verl, Hydra, renamed
    or removed key is refused with what to write instead (:func:`check_known`)."""
    from .migrations import migration_hint

    hydra = [o for o in overrides if o[:1] in "+~"]
    if hydra:
        raise ConfigError(migration_hint(hydra[0].split("=", 1)[0]))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. trainer.total_epochs=2)")
    try:
        parsed = OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {str(exc).splitlines()[0]}") from None
    check_known(parsed)
    return parsed


def merge_config(
    root: T | DictConfig, presets: Iterable[str | Path] = (), overrides: Sequence[str] | DictConfig = ()
) -> T:
    """Return a new ``root`` (a dataclass instance or class, or a structured schema built from one) with
    presets then overrides applied and validated: each dataclass is built, and its ``__post_init__`` run,
    once."""
    schema = root if isinstance(root, DictConfig) else OmegaConf.structured(root)
    layers: list[Any] = []
    for preset in presets:
        path = Path(preset)
        if not path.is_file():
            raise ConfigError(f"config preset {str(path)!r} does not exist")
        layer = OmegaConf.load(path)
        check_known(layer, f"config preset {path}")
        layers.append(layer)
    layers.append(overrides if isinstance(overrides, DictConfig) else parse_overrides(overrides))
    try:
        merged = OmegaConf.merge(schema, *layers)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc, schema)) from None


def to_yaml(cfg: Any) -> str:
    """Render a dataclass tree as YAML."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict of a dataclass tree."""
    if dataclasses.is_dataclass(cfg):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
    raise TypeError(f"expected a dataclass instance, got {type(cfg).__name__}")
