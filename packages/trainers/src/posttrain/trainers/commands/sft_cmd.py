"""``posttrain sft [--config PRESET] [key=value ...]``: supervised fine-tuning (see
posttrain.trainers.sft)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    from ..sft import run

    run(argv)
    return 0
