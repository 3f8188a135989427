"""On-disk layout of a checkpoint root, and the file operations that make it crash-safe.

```
<root>/
  latest_checkpointed_iteration.txt     # the step of the newest committed checkpoint (written last)
  global_step_<N>/
    checkpoint.json                     # step-level manifest: step, roles, trainer files
                                        # (written before rename)
    data.pt                             # trainer state (dataloader position, counters)
    <role>/                             # actor, critic, ...
      dist_ckpt/                        # torch DCP: model + optimizer keyed by HF names; extra/rank_<r>.pt
      huggingface/                      # config, tokenizer, generation config (+ safetensors with hf_model)
      manifest.json                     # contents, backend, world size, versions (written last in the role)
  .tmp.global_step_<N>/                 # a save in progress; never read, removed by the next save of N
```

A step directory only ever appears under its final name through one ``os.replace`` of a fully written and
fsynced staging directory, so a ``global_step_<N>`` directory with a readable ``checkpoint.json`` is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"
STEP_MANIFEST = "checkpoint.json"
ROLE_MANIFEST = "manifest.json"
DIST_CKPT = "dist_ckpt"
EXTRA_DIR = "extra"
HF_DIR = "huggingface"
TRAINER_STATE = "data.pt"
FORMAT = "posttrain-ckpt"
FORMAT_VERSION = 1

_STEP_RE = re.compile(r"^global_step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``global_step_<step>``."""
    if step < 0:
        raise ValueError(f"checkpoint step {step} must be >= 0")
    return f"global_step_{step}"


def staging_dir_name(step: int) -> str:
    """Name of the staging directory of ``step`` (hidden, never parsed as a checkpoint)."""
    return f".tmp.{step_dir_name(step)}"


def parse_step(name: str) -> int | None:
    """The step of a directory named exactly ``global_step_<N>``; None for anything else."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def read_json(path: Path) -> dict[str, Any] | None:
    """Parse a JSON object file; None when it is missing or not a complete JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(step_dir: Path) -> bool:
    """True when ``step_dir`` is a committed step directory whose roles all have their manifest."""
    if parse_step(step_dir.name) is None:
        return False
    manifest = read_json(step_dir / STEP_MANIFEST)
    if manifest is None or manifest.get("format") != FORMAT:
        return False
    return all(read_json(step_dir / role / ROLE_MANIFEST) is not None for role in manifest.get("roles", []))


def complete_steps(root: Path) -> dict[int, Path]:
    """All complete step directories under ``root`` by step."""
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir() and is_complete(child):
            found[step] = child
    return found


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def syncing(paths: list[Path]) -> Iterator[None]:
    """fsync ``paths`` on background threads (up to 16 at once) while the body runs; wait for them at its
    end."""
    with ThreadPoolExecutor(max(1, min(16, len(paths))), thread_name_prefix="posttrain-ckpt-fsync") as pool:
        futures = [pool.submit(fsync_path, path) for path in paths]
        yield
        for future in futures:
            future.result()


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (bottom-up), then ``root`` itself."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically write a JSON object (sorted keys, indented)."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def dir_size(path: Path) -> int:
    """Total size in bytes of the regular files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
