"""``posttrain model init --arch qwen2|qwen3|qwen3_moe --size tiny|small|0.5b|1.5b|0.6b --out DIR``: a
random-init model and tokenizer, offline."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..model_init import ARCHS, SIZES, count_parameters, init_model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain model", description="Create models without downloads.")
    sub = p.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="random-init HF model + byte-level BPE tokenizer with a chat template")
    init.add_argument("--arch", choices=ARCHS, default="qwen2")
    init.add_argument("--size", choices=tuple(SIZES), default="tiny")
    init.add_argument("--out", required=True, help="new output directory")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="pad the tokenizer with synthetic merges to exactly this many tokens (default: the size's own)",
    )
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    out = init_model(args.out, arch=args.arch, size=args.size, seed=args.seed, vocab_size=args.vocab_size)
    print(f"wrote {args.arch}/{args.size} ({count_parameters(out):,} parameters) to {out}")
    return 0
