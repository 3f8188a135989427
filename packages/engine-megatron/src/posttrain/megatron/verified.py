"""Checksums of the native Megatron checkpoint (``engine.portable_checkpoint=false``), checked like the
portable one.

A native save records in ``<role>/manifest.json`` (written last, :data:`LAYOUT` ``megatron-dist-ckpt``) under
``checksums``:

* ``tensors``: the row-hash checksum (:func:`posttrain.core.checksum.tensor_checksums`, computed on the device
  before the write), dtype, shape and finiteness of every tensor each rank holds: the model chunks' parameters
  and buffers (``model<i>.<name>@<rank>``) and the optimizer's main parameters and state
  (``optimizer.<chain>.<group>.<index>.<param|exp_avg|...>@<rank>``). A state holding NaN or inf is refused
  before anything is written.
* ``files``: the size and CRC-32s of every file of the role (dist_ckpt shards per stored item, named by
  Megatron's sharded key, ``.metadata``, ``common.pt``, ``metadata.json``, RNG state, ``huggingface/``,
  ``transformer_config.json``), as :func:`posttrain.ckpt.verify.role_file_records` records them.

A load checks every file against its record on every rank before reading any (each rank reading its share),
then the loaded tensors: finite always, and equal to their saved checksums when the parallel layout (world
size, TP, PP, DP) is the saved one (resharded tensors have other local shapes and keys). The step manager
lists the role in ``checkpoint.json`` once its manifest exists, so ``posttrain ckpt verify`` and resume's
fallback to the newest intact step cover this layout too.
"""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.ckpt.layout import FORMAT, FORMAT_VERSION, ROLE_MANIFEST, read_json, write_json
from posttrain.ckpt.verify import (
    CheckpointCorruptError,
    check_records,
    gather,
    raise_if,
    refuse_non_finite,
    role_file_records,
    tensor_records,
    verify_role,
)

from . import build

LAYOUT = "megatron-dist-ckpt"
"""The ``layout`` of a native Megatron role manifest."""


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_tensors(engine: Any, contents: list[str]) -> dict[str, torch.Tensor]:
    """The tensors this rank saves or loads for ``contents``, keyed ``<name>@<rank>``."""
    rank = _rank_world()[0]
    out: dict[str, torch.Tensor] = {}
    if "model" in contents:
        for i, chunk in enumerate(engine.chunks):
            for name, t in build.unwrap(chunk).state_dict().items():
                if isinstance(t, torch.Tensor) and not name.endswith("_extra_state"):
                    out[f"model{i}.{name}@{rank}"] = _local(t.detach())
    if "optimizer" in contents and engine.optimizer is not None:
        subs = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]
        for i, sub in enumerate(subs):
            inner = sub.optimizer
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    base = f"optimizer.{i}.{g}.{j}"
                    out[f"{base}.param@{rank}"] = _local(p.detach())
                    for kind, v in inner.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            out[f"{base}.{kind}@{rank}"] = _local(v.detach())
    return out


def layout(engine: Any) -> dict[str, int]:
    """World size and parallel sizes: the loaded tensors are compared with their records only at the same."""
    cfg = engine.engine_config
    return {
        "world": _rank_world()[1],
        "dp": engine.get_data_parallel_size(),
        "tp": cfg.tensor_model_parallel_size,
        "pp": cfg.pipeline_model_parallel_size,
        "cp": cfg.context_parallel_size,
        "ep": cfg.expert_model_parallel_size,
    }


def record_tensors(engine: Any, contents: list[str], role_dir: Path) -> dict[str, list[Any]]:
    """Checksums of every rank's tensors (collective over the default group); refuses NaN/inf before any
    write."""
    merged: dict[str, list[Any]] = {}
    for part in gather(tensor_records(local_tensors(engine, contents))):
        merged.update(part)
    refuse_non_finite(merged, f"refusing to save {role_dir}")
    return merged


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("posttrain-ckpt", "megatron-core", "megatron-bridge"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def manifest(engine: Any, contents: list[str], global_step: int, tensors: dict[str, list[Any]]) -> dict:
    """The role manifest of a native save, its ``files`` checksums still to be added
    by :func:`write_manifest`."""
    sizes = layout(engine)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "global_step": global_step,
        "contents": list(contents),
        "backend": "megatron",
        "layout": LAYOUT,
        "world_size": sizes.pop("world"),
        "parallel_sizes": sizes,
        "versions": _versions(),
        "checksums": {"tensors": tensors},
    }


def write_manifest(role_dir: Path, record: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Record the CRCs of every written file of ``role_dir`` and write its manifest last (collective over
    ``group``: the default group for a sync save, the async writer's gloo group on its thread)."""
    record["checksums"]["files"] = role_file_records(role_dir, group)
    if _rank_world()[0] == 0:
        record["written_unix"] = time.time()
        write_json(role_dir / ROLE_MANIFEST, record)
    if dist.is_initialized():
        dist.barrier(group=group)


def verify_before_load(role_dir: Path) -> dict[str, Any]:
    """Check every file of a native role against its manifest (collective); return the manifest."""
    record = read_json(role_dir / ROLE_MANIFEST)
    if record is None:
        raise CheckpointCorruptError(
            f"{role_dir / ROLE_MANIFEST}: missing or unreadable, so {role_dir} cannot be verified (its save "
            "did not finish, or the file was deleted): resume from another step "
            "(trainer.resume_from_path=<root>/global_step_<M>; `posttrain ckpt verify <root>` names the "
            "newest intact one)"
        )
    raise_if(verify_role(role_dir), f"checkpoint {role_dir}")
    return record


def check_after_load(engine: Any, contents: list[str], role_dir: Path, record: dict[str, Any]) -> None:
    """The loaded tensors are finite, and equal their saved checksums when the parallel layout is the saved
    one (collective; raises on every rank)."""
    sizes = layout(engine)
    same = sizes.pop("world") == record.get("world_size") and sizes == record.get("parallel_sizes")
    saved = record["checksums"]["tensors"] if same else None
    check_records(tensor_records(local_tensors(engine, contents)), saved, f"checkpoint {role_dir}")
