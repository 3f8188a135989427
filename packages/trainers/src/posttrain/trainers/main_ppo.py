"""PPO / GRPO entry point: ``python -m posttrain.trainers.main_ppo [--config PRESET] [key=value ...]``.

``posttrain ppo`` and ``posttrain grpo`` run the same loop; ``grpo`` only adds the built-in preset ``grpo``
(``algorithm.adv_estimator=grpo``, no critic) as the bottom layer, so your presets and then your overrides win
over it. Under torchrun every process runs this module:
``torchrun --nproc_per_node 2 -m posttrain.trainers.main_ppo trainer.n_gpus_per_node=2``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from . import preflight, threads
from .algorithms import adv_estimator_traits
from .command import exit_code
from .config import COMMAND_PRESETS, PostTrainConfig, load_config
from .rl.trainer import RLTrainer


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="RL post-training (PPO / GRPO) with a colocated rollout."
    )
    p.add_argument("--config", action="append", default=[], help="preset name or YAML file (repeatable)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=4")
    return p


def resolve(argv: Sequence[str], algorithm: str = "ppo") -> PostTrainConfig:
    """The config ``posttrain <algorithm> argv`` trains with: the command's presets, then ``--config`` presets
    in order, then ``key=value`` overrides."""
    args = parser(f"posttrain {algorithm}").parse_args(list(argv))
    return load_config(args.overrides, [*COMMAND_PRESETS[algorithm], *args.config])


def run(argv: Sequence[str], algorithm: str = "ppo") -> dict[str, Any]:
    """Train with ``argv`` and return the last step's metrics."""
    cfg = resolve(argv, algorithm)
    preflight.check_rl(cfg, use_critic=adv_estimator_traits(cfg.algorithm.adv_estimator).needs_critic)
    threads.configure()
    trainer = RLTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        png = trainer.close()
        if png is not None:
            print(f"curves: {png}", file=sys.stderr)


def _main(argv: Sequence[str] | None, algorithm: str) -> int:
    return exit_code(f"posttrain {algorithm}", lambda: run(sys.argv[1:] if argv is None else argv, algorithm))


def main(argv: Sequence[str] | None = None) -> int:
    """``posttrain ppo``."""
    return _main(argv, "ppo")


def main_grpo(argv: Sequence[str] | None = None) -> int:
    """``posttrain grpo``."""
    return _main(argv, "grpo")


if __name__ == "__main__":
    raise SystemExit(main())
