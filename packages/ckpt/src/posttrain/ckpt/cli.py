"""``posttrain ckpt``: export a checkpoint role to a Hugging Face model, or inspect a checkpoint.

    posttrain ckpt export-hf <root>/global_step_N/actor <out dir> [--dtype bfloat16] [--max-shard-size-gb 5]
                             [--adapter-only]
    posttrain ckpt inspect <root | global_step_N | global_step_N/actor> [--no-tensors]

A LoRA role is exported with its adapters merged into the base weights, or with ``--adapter-only`` as a peft
adapter directory.

Both run in one CPU process with no GPU and no process group.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.core.dtypes import DTYPES

from .hf import export_hf, tensor_table
from .layout import DIST_CKPT, ROLE_MANIFEST, STEP_MANIFEST, TRACKER, dir_size, read_json
from .manager import find_latest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain ckpt", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export-hf", help="write a loadable HF model from a checkpoint role directory")
    exp.add_argument("role_dir", type=Path, help="global_step_N/<role> of a posttrain checkpoint")
    exp.add_argument("out_dir", type=Path, help="output directory (created)")
    exp.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast the weights (default: keep the checkpoint's dtype)",
    )
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size")
    exp.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA roles: write the peft adapter (adapter_config.json, adapter_model.safetensors) instead of "
        "the merged model",
    )
    ins = sub.add_parser("inspect", help="print manifests, sizes and the tensor list")
    ins.add_argument("path", type=Path, help="checkpoint root, global_step_N, or global_step_N/<role>")
    ins.add_argument("--no-tensors", action="store_true", help="omit the tensor list")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``posttrain ckpt``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "export-hf":
            files = export_hf(
                args.role_dir,
                args.out_dir,
                DTYPES.get(args.dtype),
                int(args.max_shard_size_gb * (1 << 30)),
                adapter_only=args.adapter_only,
            )
            print(f"wrote {args.out_dir}: {', '.join(files)}")
        else:
            _inspect(args.path, tensors=not args.no_tensors)
    except ValueError as exc:
        print(f"posttrain ckpt {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _inspect(path: Path, tensors: bool) -> None:
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a directory: pass a checkpoint root, global_step_N or a role directory"
        )
    if (path / ROLE_MANIFEST).is_file():
        _inspect_role(path, tensors)
        return
    if (path / STEP_MANIFEST).is_file():
        _inspect_step(path, tensors)
        return
    latest = find_latest(path)
    if latest is None:
        raise ValueError(f"{path} holds no complete checkpoint (no {STEP_MANIFEST} / {ROLE_MANIFEST})")
    tracker = (path / TRACKER).read_text().strip() if (path / TRACKER).is_file() else None
    print(f"root {path}: tracker={tracker} latest complete=global_step_{latest[0]}")
    _inspect_step(latest[1], tensors)


def _inspect_step(step_dir: Path, tensors: bool) -> None:
    manifest = read_json(step_dir / STEP_MANIFEST) or {}
    print(f"== {step_dir} ({dir_size(step_dir) / 1e9:.3f} GB)")
    print(json.dumps(manifest, indent=2, sort_keys=True))
    for role in manifest.get("roles", []):
        _inspect_role(step_dir / role, tensors)


def _inspect_role(role_dir: Path, tensors: bool) -> None:
    print(f"== role {role_dir}")
    print(json.dumps(read_json(role_dir / ROLE_MANIFEST), indent=2, sort_keys=True))
    for sub in sorted(p for p in role_dir.iterdir() if p.is_dir()):
        print(f"{sub.name}/: {dir_size(sub) / 1e9:.3f} GB")
    if tensors and (role_dir / DIST_CKPT / ".metadata").is_file():
        rows = list(tensor_table(role_dir / DIST_CKPT))
        print(f"{len(rows)} tensors, {sum(r[3] for r in rows) / 1e9:.3f} GB")
        for key, shape, dtype, nbytes in rows:
            print(f"  {key}  {list(shape)}  {dtype}  {nbytes}")


if __name__ == "__main__":
    raise SystemExit(main())
