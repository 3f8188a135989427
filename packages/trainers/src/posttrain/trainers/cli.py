"""The ``posttrain`` command: a table of subcommands, each a module with ``main(argv) -> int``.

Subcommands of other installed posttrain packages (``posttrain ckpt``, ``posttrain convert``) come from the
``posttrain.commands`` entry-point group and are imported only when called: ``posttrain --help`` imports no
torch. ``posttrain --timing <command> ...`` prints to stderr how long the command's imports took and how long
it ran (``python -X importtime -m posttrain.trainers.cli ...`` says which imports).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Sequence
from importlib.metadata import entry_points

COMMANDS: dict[str, tuple[str, str]] = {
    "config": (
        "posttrain.trainers.commands.config_cmd:main",
        "show the resolved config: posttrain config show [k=v ...]",
    ),
    "sft": (
        "posttrain.trainers.commands.sft_cmd:main",
        "supervised fine-tuning: posttrain sft [--config P] [k=v ...]",
    ),
    "model": (
        "posttrain.trainers.commands.model_cmd:main",
        "offline models: posttrain model init --size tiny --out DIR",
    ),
    "data": (
        "posttrain.trainers.commands.data_cmd:main",
        "datasets: posttrain data synthetic|gsm8k|math --out DIR",
    ),
    "demo": ("posttrain.trainers.demo:main", "the main job: tiny model -> SFT -> GRPO on CPU, no downloads"),
    "ppo": ("posttrain.trainers.main_ppo:main", "PPO (GAE + critic): posttrain ppo [--config P] [k=v ...]"),
    "grpo": (
        "posttrain.trainers.main_ppo:main_grpo",
        "GRPO (no critic): posttrain grpo [--config P] [k=v ...]",
    ),
}
"""name -> (module:function, one-line help) for commands this package owns."""


def _plugin_commands() -> dict[str, tuple[str, str]]:
    found = {}
    for ep in entry_points(group="posttrain.commands"):
        dist = ep.dist.name if ep.dist is not None else "a plugin"
        found[ep.name] = (ep.value, f"(from {dist}) run: posttrain {ep.name} --help")
    return found


HYDRA_FLAGS = ("--config-name", "--config-path", "--config-dir", "-cn", "-cp", "-cd")
"""Hydra's command-line flags (verl's entry points take them); posttrain's commands take ``--config``."""


def _hydra_flag(args: Sequence[str]) -> str | None:
    return next((a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in HYDRA_FLAGS), None)


def _usage(commands: dict[str, tuple[str, str]]) -> str:
    lines = ["usage: posttrain [--timing] <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in sorted(commands.items())]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    args = list(sys.argv[1:] if argv is None else argv)
    timing = bool(args) and args[0] == "--timing"
    args = args[1:] if timing else args
    commands = {**_plugin_commands(), **COMMANDS}
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(commands))
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        print(f"posttrain: unknown command {name!r}\n\n{_usage(commands)}", file=sys.stderr)
        return 2
    hydra = _hydra_flag(rest)
    if hydra:
        print(
            f"posttrain {name}: {hydra} is Hydra's (verl's) flag; posttrain's is --config PRESET_OR_YAML "
            "(repeatable; a preset name or a YAML file of posttrain keys), then key=value overrides (see "
            "docs/migrating-from-verl.md)",
            file=sys.stderr,
        )
        return 2
    module, _, func = commands[name][0].partition(":")
    from .command import exit_code  # imports torch (posttrain.core): not for --help

    command = getattr(importlib.import_module(module), func)
    loaded = time.perf_counter()
    try:
        return exit_code(f"posttrain {name}", lambda: command(rest))
    finally:
        if timing:
            done = time.perf_counter()
            print(
                f"[posttrain] {name}: imports {loaded - start:.2f} s, run {done - loaded:.2f} s",
                file=sys.stderr,
            )


if __name__ == "__main__":
    raise SystemExit(main())
