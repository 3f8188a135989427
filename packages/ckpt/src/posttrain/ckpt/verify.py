"""Checksums that make a checkpoint verifiable, and the checks a load runs before anything trains on it.

A save records, in the role's ``manifest.json`` under ``checksums``:

* ``tensors``: per stored tensor chunk (DCP key ``model.<name>`` / ``optimizer.state.<name>.exp_avg`` and the
  chunk's offsets), its dtype, shape and the row-hash checksum of its bytes
  (:func:`posttrain.core.checksum.tensor_checksums`, the one the weight sync verifies buckets with), computed
  on the tensors' own device before the write, small tensors in buckets (:mod:`posttrain.ckpt.batched`);
* ``files``: per file of the role (DCP shards and ``.metadata``, extra state, ``huggingface/`` files), its
  size and the CRC-32 of each of its byte segments: in a DCP shard one segment per stored item (named by its
  key, from DCP's metadata) and one per gap between them (headers), elsewhere the whole file, all of a rank's
  files hashed on one thread pool in pieces (:mod:`posttrain.ckpt.crc`). A changed byte is thus named by file
  and tensor, a truncated file by its size, a deleted one by its absence.

The step's ``checkpoint.json`` records the trainer-state files (``data.pt``, ``data_rank_<r>.pt``) the same
way.
:func:`verify_role` and :func:`verify_step` re-read every recorded file (split over the ranks of a process
group when one exists, each rank reading its share, the findings gathered on every rank) and return what is
wrong;
:func:`check_loaded` compares the tensors a load put in memory with the recorded checksums (same chunk layout)
and refuses non-finite values. Nothing here trusts a file it has not checked: a missing manifest is itself a
finding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import dist as ckpt_dist
from .batched import checksums_and_finite
from .crc import span_crcs
from .layout import DIST_CKPT, FORMAT, ROLE_MANIFEST, STEP_MANIFEST, read_json

METADATA = ".metadata"
"""DCP's metadata file in ``dist_ckpt/``."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's files or loaded tensors do not match what its save recorded (or are not finite)."""


# ------------------------------------------------------------------ tensors
def local_chunks(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors this rank holds in nested ``state`` (DTensor and sharded-tensor shards included), keyed as
    ``<DCP key>@<offsets>``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(local_chunks(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            for offsets, local in _shards(value):
                out[f"{name}@{','.join(map(str, offsets))}"] = local
    return out


def _shards(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [(tuple(offsets), t.to_local())]
    if hasattr(t, "local_shards"):  # FSDP1's ShardedTensor
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    return [((0,) * t.dim(), t)]


def tensor_records(chunks: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """``{key: [dtype, shape, checksum, finite]}`` of local chunks, the small ones checksummed in buckets
    (:func:`posttrain.ckpt.batched.checksums_and_finite`)."""
    by_device: dict[torch.device, list[str]] = {}
    for key, t in chunks.items():
        if t.numel():
            by_device.setdefault(t.device, []).append(key)
    out: dict[str, list[Any]] = {}
    for keys in by_device.values():
        tensors = [chunks[k] for k in keys]
        sums, finite = checksums_and_finite(tensors)
        for key, t, s, f in zip(keys, tensors, sums, finite):
            out[key] = [str(t.dtype).removeprefix("torch."), list(t.shape), s, f]
    return out


def _finite_flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    flags = [
        torch.isfinite(t).all()
        if t.is_floating_point()
        else torch.ones((), dtype=torch.bool, device=t.device)
        for t in tensors
    ]
    return torch.stack(flags).cpu()


def non_finite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors of ``tensors`` that hold NaN or inf (one host sync)."""
    names = [k for k, t in tensors.items() if t.numel()]
    if not names:
        return []
    flags = _finite_flags([tensors[k] for k in names]).tolist()
    return [k for k, ok in zip(names, flags) if not ok]


def gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """``obj`` of every rank of ``group`` (``[obj]`` without a process group)."""
    if not ckpt_dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * ckpt_dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gathered_records(state: dict[str, Any], group: dist.ProcessGroup | None = None) -> dict[str, list[Any]]:
    """:func:`tensor_records` of ``state`` over every rank of ``group`` (collective)."""
    merged: dict[str, list[Any]] = {}
    for part in gather(tensor_records(local_chunks(state)), group):
        merged.update(part)
    return merged


def non_finite(records: dict[str, list[Any]]) -> list[str]:
    """Keys of the records whose tensor held a NaN or an infinity, in key order."""
    return sorted(k.split("@")[0] for k, r in records.items() if not r[3])


def refuse_non_finite(records: dict[str, list[Any]], what: str) -> None:
    """Raise :class:`CheckpointCorruptError` naming the first non-finite tensor of ``records``."""
    bad = non_finite(records)
    if bad:
        raise CheckpointCorruptError(
            f"{what}: {len(bad)} tensor(s) hold NaN or inf, first {bad[0]!r}"
            + (f" (also {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 else "")
            + ": nothing non-finite is saved or trained on; resume from an earlier checkpoint or lower the "
            "learning rate"
        )


def check_loaded(
    state: dict[str, Any],
    saved: dict[str, list[Any]] | None,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """After a load: every loaded chunk recorded with the same dtype and shape must have its recorded
    checksum, and every floating tensor must be finite (collective; raises on every rank)."""
    check_records(tensor_records(local_chunks(state)), saved, where, group)


def check_records(
    mine: dict[str, list[Any]],
    saved: dict[str, list[Any]] | None,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """:func:`check_loaded` of records already taken (:func:`tensor_records` of the loaded tensors, keyed as
    at save): a record with the saved dtype and shape must have the saved checksum, every one must be finite
    (collective; raises on every rank)."""
    problems = []
    for key, (dtype, shape, checksum, finite) in sorted(mine.items()):
        rec = (saved or {}).get(key)
        if rec is not None and rec[0] == dtype and rec[1] == shape and rec[2] != checksum:
            problems.append(f"{where}: tensor {key.split('@')[0]} does not match its saved checksum")
        if not finite:
            problems.append(f"{where}: loaded tensor {key.split('@')[0]} holds NaN or inf")
    problems = sorted({p for part in gather(problems, group) for p in part})
    if problems:
        raise CheckpointCorruptError(_report(problems, where))


# ------------------------------------------------------------------ files
def _segments(path: Path, role_dir: Path, meta: Any = None) -> list[tuple[int, int, str | None]]:
    """(offset, length, item key) of the stored items of a DCP shard file, from the DCP metadata (``meta``:
    that metadata already read, else it is read here)."""
    if path.parent.name != DIST_CKPT or path.parent.parent != role_dir or path.suffix != ".distcp":
        return []
    if meta is None:
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(path.parent)).read_metadata()
    items = []
    for index, info in meta.storage_data.items():
        if info.relative_path == path.name:
            items.append((info.offset, info.length, _item_key(index)))
    return sorted(items)


def _item_key(index: Any) -> str:
    """The key a stored item's segment is recorded under: its FQN, with the chunk's offsets when it has
    them."""
    offsets = ",".join(map(str, index.offset)) if index.offset is not None else ""
    return f"{index.fqn}@{offsets}" if offsets else index.fqn


def dcp_read_order(dcp_dir: Path) -> dict[str, int]:
    """Where each stored item of a DCP checkpoint comes in a load of its whole state: DCP reads one file after
    the other, in the order of their first items, and a file's items in the order of the state dict's keys.
    Empty when the metadata cannot be read (the file check names that damage; the order only schedules the
    reads)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception:  # missing, torn or foreign metadata: check the files in name order
        return {}
    position = {fqn: i for i, fqn in enumerate(meta.state_dict_metadata)}
    return {_item_key(index): position.get(index.fqn, len(position)) for index in meta.storage_data}


def _dcp_metadata(role_dir: Path, names: list[str]) -> Any:
    """The DCP metadata of ``role_dir/dist_ckpt`` when ``names`` hold one of its shards, else None."""
    if not any(n.startswith(f"{DIST_CKPT}/") and n.endswith(".distcp") for n in names):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(role_dir / DIST_CKPT)).read_metadata()


def _cuts(size: int, items: list[tuple[int, int, str | None]]) -> list[tuple[int, int, str | None]]:
    """``items`` and the gaps around them: (offset, length, item or None) covering ``size`` bytes once."""
    cuts, pos = [], 0
    for offset, length, key in items:
        if offset > pos:
            cuts.append((pos, offset - pos, None))
        cuts.append((offset, length, key))
        pos = offset + length
    if pos < size or not cuts:
        cuts.append((pos, size - pos, None))
    return cuts


def records_of(files: list[tuple[Path, list[tuple[int, int, str | None]]]]) -> list[list[Any]]:
    """:func:`file_record` of each ``(path, items)``, every file's segments hashed on one thread pool
    (:func:`posttrain.ckpt.crc.span_crcs`)."""
    cuts = [_cuts(path.stat().st_size, items) for path, items in files]
    crcs = span_crcs([(path, [(o, n) for o, n, _ in c]) for (path, _), c in zip(files, cuts)])
    return [
        [sum(n for _, n, _ in c), [[o, n, crc, k] for (o, n, k), crc in zip(c, now)]]
        for c, now in zip(cuts, crcs)
    ]


def file_record(path: Path, items: list[tuple[int, int, str | None]]) -> list[Any]:
    """``[size, [[offset, length, crc32, item or None], ...]]`` of one file, covering every byte once."""
    return records_of([(path, items)])[0]


def listed_files(role_dir: Path) -> list[str]:
    """The files of a role directory, relative to it, sorted: all but its manifest and temporary files."""
    return sorted(
        str(p.relative_to(role_dir))
        for p in role_dir.rglob("*")
        if p.is_file() and p.name != ROLE_MANIFEST and not p.name.startswith(".tmp")
    )


def file_records(
    base: Path, names: list[str], group: dist.ProcessGroup | None = None, role_dir: Path | None = None
) -> dict[str, list[Any]]:
    """:func:`file_record` of ``base/<name>`` for each name, the files split over the ranks of ``group``
    (collective when a process group exists)."""
    rank, world = ckpt_dist.get_rank(group), ckpt_dist.get_world_size(group)
    names = names[rank::world]
    role_dir = role_dir or base
    meta = _dcp_metadata(role_dir, names) if base == role_dir else None
    found = records_of([(base / n, _segments(base / n, role_dir, meta)) for n in names])
    merged: dict[str, list[Any]] = {}
    for part in gather(dict(zip(names, found)), group):
        merged.update(part)
    return merged


def role_file_records(role_dir: Path, group: dist.ProcessGroup | None = None) -> dict[str, list[Any]]:
    """Checksums of every file of a written role directory but its manifest (collective)."""
    return file_records(role_dir, listed_files(role_dir), group, role_dir)


def check_files(base: Path, records: dict[str, list[Any]], order: dict[str, int] | None = None) -> list[str]:
    """What is wrong with each ``base/<name>`` of ``records`` against its record (empty when all are intact);
    the segments of the files of the recorded size are hashed on one thread pool, in name order with
    read-ahead or, with ``order`` (:func:`dcp_read_order`: a DCP load reads the same files meanwhile), in the
    order that load reads them and without read-ahead hints, so that the check follows the load's reads
    instead of competing with them elsewhere on the disk."""
    problems, whole = [], []
    for name, (size, _) in sorted(records.items()):
        path = base / name
        if not path.is_file():
            problems.append(f"{path}: missing (recorded with {size} bytes)")
        elif (now := path.stat().st_size) != size:
            problems.append(f"{path}: {now} bytes, saved with {size} (torn or truncated)")
        else:
            whole.append(name)
    beside_load, order = order is not None, order or {}
    reads = {
        n: sorted(range(len(records[n][1])), key=lambda i: order.get(records[n][1][i][3], -1)) for n in whole
    }
    whole.sort(key=lambda n: min((order[k] for *_, k in records[n][1] if k in order), default=-1))
    spans = [(base / n, [tuple(records[n][1][i][:2]) for i in reads[n]]) for n in whole]
    crcs = span_crcs(spans, read_ahead=not beside_load)
    for name, now in zip(whole, crcs):
        crc_of = dict(zip(reads[name], now))
        problems += [
            f"{base / name}: bytes {o}-{o + n} ({_what(k)}) changed"
            for i, (o, n, c, k) in enumerate(records[name][1])
            if c != crc_of[i]
        ]
    return sorted(problems)


def check_file(base: Path, name: str, record: list[Any]) -> list[str]:
    """What is wrong with ``base/name`` against its record (empty when intact)."""
    return check_files(base, {name: record})


def _what(key: str | None) -> str:
    if key is None:
        return "bytes outside any stored item"
    return f"tensor {key.split('@')[0]}" if "@" in key else f"stored value {key}"


def verify_files(
    base: Path, records: dict[str, list[Any]], group: dist.ProcessGroup | None = None
) -> list[str]:
    """:func:`check_file` of every recorded file, split over the ranks of ``group`` (collective)."""
    rank, world = ckpt_dist.get_rank(group), ckpt_dist.get_world_size(group)
    mine = check_files(base, {n: records[n] for n in sorted(records)[rank::world]})
    return sorted(p for part in gather(mine, group) for p in part)


def verify_role(role_dir: str | Path, group: dist.ProcessGroup | None = None) -> list[str]:
    """What is wrong with one role directory (empty when intact; collective)."""
    role_dir = Path(role_dir)
    manifest = read_json(role_dir / ROLE_MANIFEST)
    if manifest is None:
        return [
            f"{role_dir / ROLE_MANIFEST}: missing or unreadable (the role's save did not finish, or it was "
            "deleted)"
        ]
    checksums = manifest.get("checksums")
    if not checksums:
        return []  # saved before checksums were recorded: nothing to compare
    return verify_files(role_dir, checksums["files"], group)


@contextlib.contextmanager
def verified_read(role_dir: str | Path, what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Check this rank's share of a role's recorded files on a background thread while the body reads them
    (the disk is read once, the CRCs overlap the load), then gather every rank's findings (collective) and
    raise
    :class:`CheckpointCorruptError` naming them. When the body fails, the findings are raised from its error
    (a damaged file is the cause); with none, its error goes on. A role without its manifest is refused
    first."""
    role_dir = Path(role_dir)
    manifest = read_json(role_dir / ROLE_MANIFEST)
    if manifest is None:
        raise_if(verify_role(role_dir, group), what)
    records = (manifest.get("checksums") or {}).get("files", {})
    rank, world = ckpt_dist.get_rank(group), ckpt_dist.get_world_size(group)
    mine = {n: records[n] for n in sorted(records)[rank::world]}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-ckpt-verify") as pool:
        future = pool.submit(lambda: check_files(role_dir, mine, dcp_read_order(role_dir / DIST_CKPT)))
        try:
            yield
        except BaseException:
            raise_if(sorted(p for part in gather(future.result(), group) for p in part), what)
            raise
        raise_if(sorted(p for part in gather(future.result(), group) for p in part), what)


def verify_step(step_dir: str | Path, group: dist.ProcessGroup | None = None) -> list[str]:
    """What is wrong with one ``global_step_<N>`` directory: its ``checkpoint.json``, trainer-state files and
    every role (empty when intact; collective)."""
    step_dir = Path(step_dir)
    manifest = read_json(step_dir / STEP_MANIFEST)
    if manifest is None or manifest.get("format") != FORMAT:
        return [
            f"{step_dir / STEP_MANIFEST}: missing or unreadable (the step's save did not finish, or it "
            "was deleted)"
        ]
    problems = verify_files(step_dir, manifest.get("checksums", {}), group)
    for role in manifest.get("roles", []):
        problems += verify_role(step_dir / role, group)
    return problems


def raise_if(problems: list[str], what: str) -> None:
    """Raise :class:`CheckpointCorruptError` listing ``problems`` when there are any."""
    if problems:
        raise CheckpointCorruptError(_report(problems, what))


def _report(problems: list[str], what: str) -> str:
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    return (
        f"{what} failed verification:\n  "
        + "\n  ".join(shown)
        + "\n(it was changed or lost after its save; `posttrain ckpt verify <checkpoint root>` names the "
        "newest intact step, which trainer.resume_mode=auto resumes from)"
    )
