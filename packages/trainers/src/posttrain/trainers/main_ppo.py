"""PPO / GRPO entry point: ``python -m posttrain.trainers.main_ppo [--config PRESET] [key=value ...]``.

``posttrain ppo`` and ``posttrain grpo`` run the same loop; ``grpo`` only changes the defaults
(``algorithm.adv_estimator=grpo``, no critic) before your presets and overrides apply. Under torchrun every
process runs this module: ``torchrun --nproc_per_node 2 -m posttrain.trainers.main_ppo trainer.n_gpus_per_node=2``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from posttrain.core.config.loader import ConfigError

from . import preflight, threads
from .algorithms import adv_estimator_traits
from .config import load_config
from .rl.trainer import RLTrainer

ALGORITHM_DEFAULTS = {"ppo": [], "grpo": ["algorithm.adv_estimator=grpo"]}


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="RL post-training (PPO / GRPO) with a colocated rollout."
    )
    p.add_argument("--config", action="append", default=[], help="preset name or YAML file (repeatable)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=4")
    return p


def run(argv: Sequence[str], algorithm: str = "ppo") -> dict[str, Any]:
    """Train with ``argv`` and return the last step's metrics."""
    args = parser(f"posttrain {algorithm}").parse_args(list(argv))
    cfg = load_config([*ALGORITHM_DEFAULTS[algorithm], *args.overrides], args.config)
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
    try:
        run(sys.argv[1:] if argv is None else argv, algorithm)
    except ConfigError as exc:
        print(f"posttrain {algorithm}: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``posttrain ppo``."""
    return _main(argv, "ppo")


def main_grpo(argv: Sequence[str] | None = None) -> int:
    """``posttrain grpo``."""
    return _main(argv, "grpo")


if __name__ == "__main__":
    raise SystemExit(main())
