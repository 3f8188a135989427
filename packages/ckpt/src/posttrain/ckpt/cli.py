"""``posttrain ckpt``: export a checkpoint role to a Hugging Face model, or inspect a checkpoint.

    posttrain ckpt export-hf <root>/global_step_N/actor <out dir> [--dtype bfloat16] [--max-shard-size-gb 5]
                             [--adapter-only]
    posttrain ckpt inspect <root | global_step_N | global_step_N/actor> [--no-tensors]
    posttrain ckpt verify <root | global_step_N | global_step_N/actor>

``verify`` re-reads every file of the checkpoint against the checksums its save recorded and names each
missing, truncated or changed file (and the tensor in it); for a root it checks every step and says which is
the newest intact one. Exit status 0: intact, 1: a problem found, 2: bad arguments. ``export-hf`` runs the
same check first.

A LoRA role is exported with its adapters merged into the base weights, or with ``--adapter-only`` as a peft
adapter directory.

All run in one CPU process with no GPU and no process group.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.core.dtypes import DTYPES

from .hf import export_hf, tensor_table
from .layout import DIST_CKPT, ROLE_MANIFEST, STEP_MANIFEST, TRACKER, dir_size, parse_step, read_json
from .manager import find_latest
from .verify import CheckpointCorruptError, verify_role, verify_step


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
    ver = sub.add_parser("verify", help="check every file of a checkpoint against its recorded checksums")
    ver.add_argument("path", type=Path, help="checkpoint root, global_step_N, or global_step_N/<role>")
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
        elif args.command == "verify":
            return _verify(args.path)
        else:
            _inspect(args.path, tensors=not args.no_tensors)
    except CheckpointCorruptError as exc:
        print(f"posttrain ckpt {args.command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"posttrain ckpt {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _verify(path: Path) -> int:
    """Print what is wrong with a role, a step or every step of a root; 0 when all is intact, else 1."""
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a directory: pass a checkpoint root, global_step_N or a role directory"
        )
    if (path / ROLE_MANIFEST).is_file():
        targets = {path: verify_role(path)}
    elif parse_step(path.name) is not None:
        targets = {path: verify_step(path)}
    else:
        steps = sorted((s, p) for p in path.iterdir() if (s := parse_step(p.name)) is not None and p.is_dir())
        if not steps:
            raise ValueError(
                f"{path} holds no global_step_<N> directory: pass a checkpoint root, step or role"
            )
        targets = {p: verify_step(p) for _, p in reversed(steps)}
    for target, problems in targets.items():
        print(f"{target}: {'intact' if not problems else 'DAMAGED'}")
        for problem in problems:
            print(f"  {problem}")
    intact = [t for t, problems in targets.items() if not problems]
    if len(targets) > 1:
        print(f"newest intact: {intact[0] if intact else 'none'}")
    return 0 if len(intact) == len(targets) else 1


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
    manifest.pop("checksums", None)
    print(f"== {step_dir} ({dir_size(step_dir) / 1e9:.3f} GB)")
    print(json.dumps(manifest, indent=2, sort_keys=True))
    for role in manifest.get("roles", []):
        _inspect_role(step_dir / role, tensors)


def _inspect_role(role_dir: Path, tensors: bool) -> None:
    print(f"== role {role_dir}")
    manifest = read_json(role_dir / ROLE_MANIFEST) or {}
    checksums = manifest.pop("checksums", None) or {}
    print(json.dumps(manifest, indent=2, sort_keys=True))
    print(f"checksums: {len(checksums.get('tensors', {}))} tensors, {len(checksums.get('files', {}))} files")
    for sub in sorted(p for p in role_dir.iterdir() if p.is_dir()):
        print(f"{sub.name}/: {dir_size(sub) / 1e9:.3f} GB")
    if tensors and (role_dir / DIST_CKPT / ".metadata").is_file():
        rows = list(tensor_table(role_dir / DIST_CKPT))
        print(f"{len(rows)} tensors, {sum(r[3] for r in rows) / 1e9:.3f} GB")
        for key, shape, dtype, nbytes in rows:
            print(f"  {key}  {list(shape)}  {dtype}  {nbytes}")


if __name__ == "__main__":
    raise SystemExit(main())
