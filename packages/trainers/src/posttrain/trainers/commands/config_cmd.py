"""``posttrain config show [sft|rl] [--config PRESET_OR_YAML ...] [key=value ...]``: print the tree a command
will use, as YAML, each node named by its config class and each field by the package that owns it.

``sft`` is the tree of ``posttrain sft``; ``rl`` (the default, also ``ppo`` / ``grpo``) the tree of the RL
trainers; ``grpo`` adds the preset ``posttrain grpo`` puts under yours. The output loads back with
``--config``: the annotations are YAML comments.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

TREES = {"sft": "SFTConfig", "rl": "PostTrainConfig", "ppo": "PostTrainConfig", "grpo": "PostTrainConfig"}
"""Command word -> its root config class in :mod:`posttrain.trainers.config`."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain config", description="Inspect configs.")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser(
        "show", help="print the resolved config (defaults <- presets <- overrides) of sft or the RL trainers"
    )
    show.add_argument("--config", action="append", default=[], help="preset name or YAML file (repeatable)")
    show.add_argument(
        "args",
        nargs="*",
        help="optionally sft or rl (default rl), then key=value overrides, e.g. model_engine=fsdp",
    )
    return p


def owner(cls: type) -> str:
    """The distribution that ships ``cls``: the one that registered a config class of the same top module (an
    engine or rollout plugin), else posttrain's own package of that module."""
    from posttrain.core.registry import ENGINE_GROUP, ROLLOUT_GROUP, installed

    module = cls.__module__
    package = ".".join(module.split(".")[:2])
    for group in (ENGINE_GROUP, ROLLOUT_GROUP):
        reg = installed(group)
        for name in reg.names():
            if reg._targets[name].split(":")[0].startswith(package + "."):
                return reg.source(name)
    own = {"posttrain.core": "posttrain-engine-core", "posttrain.trainers": "posttrain-trainers"}
    return own.get(package, package)


def declaring_class(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose body declares field ``name``."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def render(node: Any, indent: str = "") -> list[str]:
    """YAML lines of a dataclass tree, each field followed by ``# <package>`` and each node by its class."""
    import yaml
    from omegaconf import OmegaConf

    lines = []
    for spec in dataclasses.fields(node):
        value = getattr(node, spec.name)
        package = owner(declaring_class(type(node), spec.name))
        if dataclasses.is_dataclass(value):
            lines.append(f"{indent}{spec.name}:  # {type(value).__name__} ({owner(type(value))})")
            lines += render(value, indent + "  ")
            continue
        if isinstance(value, list | dict):  # flow style: one line per field
            text = f"{spec.name}: " + yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
        else:
            text = OmegaConf.to_yaml({spec.name: value}).rstrip("\n")
        lines.append(f"{indent}{text}  # {package}")
    return lines


def main(argv: Sequence[str]) -> int:
    from .. import config

    args = parser().parse_args(list(argv))
    words = args.args
    tree = words[0] if words and "=" not in words[0] else "rl"
    if tree not in TREES:
        raise config.ConfigError(
            f"posttrain config show {tree}: name a tree ({', '.join(TREES)}) or give key=value"
        )
    overrides = words[1:] if words and words[0] == tree else words
    root = getattr(config, TREES[tree])
    presets = [*config.COMMAND_PRESETS.get(tree, []), *args.config]  # the command's own presets first
    cfg = config.load_config(overrides, presets, root=root)
    print(f"# the tree of posttrain {tree} ({root.__name__})")
    print("\n".join(render(cfg)))
    return 0
