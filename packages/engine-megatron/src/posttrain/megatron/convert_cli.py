"""``posttrain convert hf-to-megatron|megatron-to-hf``: offline checkpoint conversion
(see :mod:`.convert`)."""

from __future__ import annotations

import argparse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain convert", description=__doc__)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mc = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron dist_ckpt")
    to_mc.add_argument("--hf-model", required=True, help="local HF model directory")
    to_hf = sub.add_parser("megatron-to-hf", help="Megatron dist_ckpt -> HF safetensors")
    to_hf.add_argument("--input", required=True, help="directory holding dist_ckpt/ and huggingface/")
    for p in (to_mc, to_hf):
        p.add_argument("--output", required=True, help="directory to write")
        p.add_argument(
            "--tp", type=int, default=1, help="tensor-parallel size of the processes doing the work"
        )
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; returns 0 on success (argument errors exit through argparse)."""
    args = _parser().parse_args(argv)
    for name in ("tp", "pp", "ep"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 1")
    from . import convert

    if args.direction == "hf-to-megatron":
        convert.hf_to_megatron(args.hf_model, args.output, args.tp, args.pp, args.ep)
    else:
        convert.megatron_to_hf(args.input, args.output, args.tp, args.pp, args.ep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
