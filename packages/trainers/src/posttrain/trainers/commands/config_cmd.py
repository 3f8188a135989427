"""``posttrain config show [--config PRESET_OR_YAML ...] [key=value ...]``: print the resolved config as YAML."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from posttrain.core.config.loader import to_yaml

from ..config import load_config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain config", description="Inspect configs.")
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config (defaults <- presets <- overrides)")
    show.add_argument("--config", action="append", default=[], help="preset name or YAML file (repeatable)")
    show.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model_engine=megatron")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    print(to_yaml(load_config(args.overrides, args.config)), end="")
    return 0
