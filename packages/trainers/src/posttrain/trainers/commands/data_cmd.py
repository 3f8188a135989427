"""``posttrain data synthetic|gsm8k|math``: write train/test parquet with SFT and RL columns (offline)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..data.convert import convert, read_records, write_parquet
from ..data.synthetic import TASKS, synthetic_rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain data", description="Make datasets (nothing is downloaded).")
    sub = p.add_subparsers(dest="action", required=True)
    syn = sub.add_parser(
        "synthetic", help="a task a tiny model learns in minutes -> OUT/{train,test}.parquet"
    )
    syn.add_argument("--task", choices=TASKS, default="arithmetic")
    syn.add_argument("--out", required=True, help="output directory")
    syn.add_argument("--num-train", type=int, default=2000)
    syn.add_argument("--num-test", type=int, default=200)
    syn.add_argument("--digits", type=int, default=2, help="digits per operand (arithmetic)")
    syn.add_argument("--seed", type=int, default=0)
    for name in ("gsm8k", "math"):
        conv = sub.add_parser(name, help=f"convert a local {name} parquet/jsonl -> OUT/<split>.parquet")
        conv.add_argument(
            "--input", required=True, help="local .parquet or .jsonl in the dataset's own format"
        )
        conv.add_argument("--out", required=True, help="output directory")
        conv.add_argument(
            "--split",
            choices=("train", "test"),
            default=None,
            help="split name (default: test if the input file name contains 'test', else train)",
        )
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    out = Path(args.out)
    if args.action == "synthetic":
        splits = synthetic_rows(args.task, args.num_train, args.num_test, digits=args.digits, seed=args.seed)
        for split, rows in splits.items():
            print(f"wrote {len(rows)} rows to {write_parquet(rows, out / f'{split}.parquet')}")
        return 0
    split = args.split or ("test" if "test" in Path(args.input).name else "train")
    rows = convert(args.action, read_records(args.input), split, path=args.input)
    print(f"wrote {len(rows)} rows to {write_parquet(rows, out / f'{split}.parquet')}")
    return 0
