"""Save and load one role (actor, critic, ...) of a torch model: DCP shards keyed by HF names, extra, HF
files.

``torch.distributed.checkpoint.state_dict.get_state_dict`` gives the model state under the module's own FQNs
(wrapper prefixes such as FSDP1's or activation checkpointing's are stripped), which for a Hugging Face model
are its HF parameter names, and the optimizer state flattened per parameter (``state.<name>.exp_avg``,
``param_groups.<name>.lr``). Under FSDP2 these are DTensors, under FSDP1 sharded tensors, in one process plain
tensors; DCP stores global shapes and offsets, so a checkpoint written by N ranks loads on M ranks.
``set_state_dict`` puts loaded values back through the same mapping. A tied parameter is written once, under
the first of its names; the manifest's ``tied_aliases`` maps the other names to it and load fills them back in
(:mod:`posttrain.ckpt.tied`). The role's ``manifest.json`` is written last.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from posttrain.core.config.checkpoint import check_contents

from . import dist as ckpt_dist
from .extra import capture_extra, load_extra, save_extra
from .hf import HF_LAYOUT, write_hf_metadata, write_safetensors
from .layout import (
    DIST_CKPT,
    EXTRA_DIR,
    FORMAT,
    FORMAT_VERSION,
    HF_DIR,
    ROLE_MANIFEST,
    read_json,
    syncing,
    write_json,
)
from .lora import is_lora_state, merge_lora, peft_config_of
from .snapshot import snapshot_to_host
from .staging import HostStaging, StagingSavePlanner, staging_device
from .tied import drop_aliases, fill_aliases, tied_aliases
from .verify import (
    check_loaded,
    gathered_records,
    listed_files,
    raise_if,
    refuse_non_finite,
    role_file_records,
    verified_read,
    verify_role,
)
from .writer import AsyncWriter

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(kw_only=True)
class RoleState:
    """What one role checkpoints: the (possibly sharded) model and its training state."""

    model: torch.nn.Module
    """The model, plain or wrapped by FSDP1/FSDP2; its FQNs are HF parameter names."""
    optimizer: torch.optim.Optimizer | None = None
    """Its optimizer (None for forward-only roles)."""
    lr_scheduler: Any | None = None
    """Anything with ``state_dict``/``load_state_dict`` (a torch LR scheduler)."""
    counters: dict[str, Any] = field(default_factory=dict)
    """Step counters saved in extra (e.g. global_step, skipped_steps)."""


@dataclass(kw_only=True)
class RoleInfo:
    """Description of a role written into its manifest and its ``huggingface/`` directory."""

    backend: str = "torch"
    """Training backend that wrote the checkpoint (fsdp, fsdp2, megatron, torch)."""
    parallel_sizes: dict[str, int] = field(default_factory=dict)
    """Parallel layout at save time (dp, fsdp, tp, ...)."""
    hf_config: Any | None = None
    """A transformers config (``save_pretrained``) or None to copy ``model_dir/config.json``."""
    model_dir: str | None = None
    """The HF model directory the role started from (config, generation config)."""
    tokenizer_dir: str | None = None
    """Tokenizer directory (default ``model_dir``)."""
    dcp_thread_count: int = 4
    """Writer threads per rank for the DCP files."""
    peft_config: dict[str, dict[str, Any]] | None = None
    """LoRA adapter configs, ``{adapter name: LoraConfig.to_dict()}``, for a module that is not a peft model
    itself; None reads them from the module's ``peft_config`` (a peft model, FSDP-wrapped or not). Recorded in
    the manifest, where ``export-hf`` takes ``lora_alpha`` and the rest to merge the adapters."""


def _check_save(state: RoleState, contents: list[str]) -> None:
    check_contents(contents, "checkpoint.save_contents")
    if "optimizer" in contents and state.optimizer is None:
        raise ValueError(
            f"checkpoint.save_contents={contents} lists optimizer but this role has no optimizer "
            "(forward-only): remove optimizer from checkpoint.save_contents"
        )


def _sharded_state(state: RoleState, contents: list[str]) -> dict[str, Any]:
    """The (sharded) model and flattened optimizer state of ``contents``, every name of a tied tensor
    included."""
    if "optimizer" in contents:
        msd, osd = get_state_dict(state.model, state.optimizer, options=_OPTIONS)
        return {"model": msd, "optimizer": osd}
    if "model" in contents:
        return {"model": get_model_state_dict(state.model, options=_OPTIONS)}
    return {}


def _deduplicated_state(state: RoleState, contents: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """What save writes: :func:`_sharded_state` with each tied tensor under one name; and the aliases."""
    sharded = _sharded_state(state, contents)
    if "model" not in sharded:
        return sharded, {}
    aliases = tied_aliases(state.model, list(sharded["model"]))
    return {**sharded, "model": drop_aliases(sharded["model"], aliases)}, aliases


def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    # cpu_offload keeps the gathered tensors on rank 0 only; FSDP1's rank0-only path segfaults on CPU
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=on_cuda))


def save_role(
    role_dir: str | Path,
    state: RoleState,
    info: RoleInfo,
    contents: list[str],
    global_step: int,
    writer: AsyncWriter | None = None,
    verify: bool = True,
) -> None:
    """Write one role into ``role_dir`` on every rank (collective).

    With ``writer`` this blocks only for the device-to-host snapshot (plus the full-model gather when
    ``hf_model`` is saved) and queues the file writes on the writer's thread; the first such save also
    allocates the host buffers unless :func:`prepare_role` allocated them ahead. A tied parameter is written
    once, a LoRA model's adapter config goes into the manifest, and ``hf_model`` holds the merged weights.
    With ``verify`` (the default) the manifest records every tensor's and file's checksums
    (:mod:`posttrain.ckpt.verify`) and a state holding NaN or inf is refused before anything is written;
    ``verify=False`` only for measuring its cost.
    """
    role_dir = Path(role_dir)
    _check_save(state, contents)
    sharded, aliases = _deduplicated_state(state, contents)
    extra = capture_extra(state.lr_scheduler, state.counters) if "extra" in contents else None
    full = _full_model_state(state.model) if "hf_model" in contents else None
    rank, world = ckpt_dist.get_rank(), ckpt_dist.get_world_size()
    manifest = _manifest(state, info, contents, global_step, world) | {"tied_aliases": aliases}
    manifest["verify"] = verify
    if verify:  # checksums on the tensors' own device, before any byte leaves it; nothing non-finite is saved
        manifest["checksums"] = {"tensors": gathered_records(sharded)}
        refuse_non_finite(manifest["checksums"]["tensors"], f"refusing to save {role_dir}")
    if full is not None and rank == 0 and manifest["peft_config"] and is_lora_state(full):
        full = merge_lora(full, manifest["peft_config"])  # hf_model: the merged model, loadable as is
    if writer is None:
        write_role_files(role_dir, sharded, extra, full, info, manifest, rank, None)
        return
    key = role_dir.name
    extra = copy.deepcopy(extra)
    buffers = writer.ready_buffers()  # waits for a prepare_role still allocating
    sharded = snapshot_to_host(sharded, buffers, f"{key}/sharded")
    if full is not None and rank == 0:
        full = snapshot_to_host(full, buffers, f"{key}/full")
    writer.submit(
        write_role_files, role_dir, sharded, extra, full, info, manifest, rank, writer.process_group
    )


def prepare_role(role: str, state: RoleState, contents: list[str], writer: AsyncWriter) -> Future:
    """Start allocating, in the background, the host buffers of an async :func:`save_role` of ``state`` into a
    directory named ``role`` (actor, critic, ...), so that the first async save blocks no longer than later
    ones.

    Call it on every rank (``get_state_dict`` may be collective) after the first optimizer step (an empty
    optimizer state has no shapes yet); it returns at once with the allocation's future (result: the buffers
    by key path). Buffers for the ``hf_model`` gather are not prepared.
    """
    _check_save(state, contents)
    if "optimizer" in contents and not state.optimizer.state:
        raise ValueError(
            f"prepare_role({role!r}) with optimizer in checkpoint.save_contents={contents} needs the "
            "optimizer state, which is empty before the first optimizer step: call it after the first step"
        )
    sharded, _ = _deduplicated_state(state, contents)
    return writer.prepare(sharded, f"{role}/sharded")


def write_role_files(
    role_dir: Path,
    sharded: dict[str, Any] | None,
    extra: dict[str, Any] | None,
    full: dict[str, torch.Tensor] | None,
    info: RoleInfo,
    manifest: dict[str, Any],
    rank: int,
    group: dist.ProcessGroup | None,
    tie_word_embeddings: bool | None = None,
) -> None:
    """Write a role's files from host (or device) state: the DCP ``sharded`` state, this rank's ``extra``, and
    on rank 0 the ``huggingface/`` metadata and ``full`` weights as safetensors (without ``lm_head`` when
    ``tie_word_embeddings``; None reads it from ``info.hf_config``), then the manifest last, once every file
    of the role is fsynced (each rank fsyncs its share while it computes that share's CRCs). Collective over
    ``group`` (the default group for a sync save, the async writer's gloo group on its thread). Engines with
    their own state collection (the Megatron portable save) write through this too."""
    role_dir.mkdir(parents=True, exist_ok=True)
    if sharded:
        _dcp_write(role_dir / DIST_CKPT, sharded, info.dcp_thread_count, group)
    if extra is not None:
        save_extra(role_dir / DIST_CKPT / EXTRA_DIR, rank, extra)
    if rank == 0:
        write_hf_metadata(role_dir / HF_DIR, info.hf_config, info.model_dir, info.tokenizer_dir)
        if full is not None:
            tie = tie_word_embeddings
            if tie is None:
                tie = bool(getattr(info.hf_config, "tie_word_embeddings", False))
            manifest["hf_files"] = write_safetensors(role_dir / HF_DIR, full, tie_word_embeddings=tie)
    ckpt_dist.barrier(group)
    share = listed_files(role_dir)[ckpt_dist.get_rank(group) :: ckpt_dist.get_world_size(group)]
    with syncing([role_dir / name for name in share]):  # the disk writes while the CRCs are computed
        checksums = manifest.get("checksums")
        if checksums is not None or manifest.get("verify", True):
            if checksums is None:  # a caller that collected the state itself (the Megatron portable save)
                checksums = {"tensors": gathered_records(sharded or {}, group)}
                refuse_non_finite(checksums["tensors"], f"refusing to save {role_dir}")
            checksums["files"] = role_file_records(role_dir, group)
            manifest["checksums"] = checksums
    manifest.pop("verify", None)
    if rank == 0:
        manifest["written_unix"] = time.time()
        write_json(role_dir / ROLE_MANIFEST, manifest)
    ckpt_dist.barrier(group)


def _dcp_write(dcp_dir: Path, sharded: dict[str, Any], threads: int, group: dist.ProcessGroup | None) -> None:
    """DCP's save of ``sharded`` into ``dcp_dir`` (collective), device tensors through page-locked host
    copies, without DCP's own fsync: :func:`write_role_files` fsyncs the files while it computes their
    CRCs."""
    writer = dcp.FileSystemWriter(str(dcp_dir), thread_count=threads, sync_files=False)
    device = staging_device(sharded)
    staging = HostStaging(device)
    planner = None if device is None else StagingSavePlanner(staging)
    try:
        with ckpt_dist.single_process_dcp() as no_dist:
            dcp.save(sharded, storage_writer=writer, planner=planner, process_group=group, no_dist=no_dist)
    finally:
        staging.release()


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _manifest(
    state: RoleState, info: RoleInfo, contents: list[str], global_step: int, world: int
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "global_step": global_step,
        "contents": list(contents),
        "backend": info.backend,
        "layout": HF_LAYOUT,
        "optimizer": type(state.optimizer).__name__ if state.optimizer is not None else None,
        "world_size": world,
        "parallel_sizes": dict(info.parallel_sizes),
        "peft_config": info.peft_config or peft_config_of(state.model),
        "versions": {
            "torch": torch.__version__,
            "posttrain-ckpt": _version("posttrain-ckpt"),
            "transformers": _version("transformers"),
        },
    }


def read_role_manifest(role_dir: str | Path) -> dict[str, Any]:
    """The manifest of a complete role directory; ValueError when it is missing."""
    manifest = read_json(Path(role_dir) / ROLE_MANIFEST)
    if manifest is None:
        raise ValueError(
            f"{role_dir} has no readable {ROLE_MANIFEST}: it is not a complete posttrain checkpoint "
            "role directory (pass global_step_N/<role> of a committed checkpoint)"
        )
    return manifest


def load_role(
    role_dir: str | Path, state: RoleState, contents: list[str], verify: bool = True
) -> dict[str, Any]:
    """Restore ``contents`` of one role into ``state`` on every rank (collective); return the saved counters.

    With ``verify`` (the default) every file is checked against the manifest's checksums (on a background
    thread while DCP reads them, and before anything loaded is set or the extra state read), then the loaded
    tensors against their recorded checksums and for NaN/inf:
    a :class:`~posttrain.ckpt.verify.CheckpointCorruptError` names the file and tensor. ``verify=False`` only
    for measuring its cost."""
    role_dir = Path(role_dir)
    check_contents(contents, "checkpoint.load_contents")
    manifest = read_role_manifest(role_dir)
    _check_load(role_dir, state, contents, manifest["contents"])
    if "model" in contents:
        saved = (manifest.get("checksums") or {}).get("tensors") if verify else None
        _load_sharded(role_dir, state, contents, manifest.get("tied_aliases", {}), saved, verify)
    elif verify:
        raise_if(verify_role(role_dir), f"checkpoint {role_dir}")
    if "extra" in contents:
        return load_extra(role_dir / DIST_CKPT / EXTRA_DIR, ckpt_dist.get_rank(), state.lr_scheduler)
    return {}


def _check_load(role_dir: Path, state: RoleState, contents: list[str], saved: list[str]) -> None:
    missing = [c for c in contents if c not in saved and c != "hf_model"]
    if missing:
        raise ValueError(
            f"checkpoint.load_contents={contents} asks for {missing} but {role_dir} was saved with "
            f"save_contents={saved}: remove {missing} from checkpoint.load_contents"
        )
    if "optimizer" in contents and state.optimizer is None:
        raise ValueError(
            f"checkpoint.load_contents={contents} lists optimizer but this role has no optimizer "
            "(forward-only): remove optimizer from checkpoint.load_contents"
        )


def _load_sharded(
    role_dir: Path,
    state: RoleState,
    contents: list[str],
    aliases: dict[str, str],
    saved: dict[str, list[Any]] | None,
    verify: bool,
) -> None:
    """DCP-load model (+ optimizer) in place; with ``verify`` the role's files are checked while DCP reads
    them (:func:`~posttrain.ckpt.verify.verified_read`), then the loaded tensors against ``saved`` checksums
    and for NaN/inf, before any of it is set; names stored as tied aliases are filled from their kept name."""
    sharded = _sharded_state(state, contents)
    model_sd = sharded["model"]
    stored = {k: v for k, v in model_sd.items() if not (k in aliases and aliases[k] in model_sd)}
    to_read = {**sharded, "model": stored}
    reader = dcp.FileSystemReader(str(role_dir / DIST_CKPT))
    # with verify: every file of the role against its checksums while DCP reads them (one pass over the disk)
    checking = verified_read(role_dir, f"checkpoint {role_dir}") if verify else contextlib.nullcontext()
    with checking, ckpt_dist.single_process_dcp() as no_dist:
        dcp.load(to_read, storage_reader=reader, no_dist=no_dist)
    if verify:
        check_loaded(to_read, saved, f"checkpoint {role_dir}")
    model_sd = fill_aliases(to_read["model"], {a: k for a, k in aliases.items() if a in model_sd})
    if "optimizer" in to_read:
        set_state_dict(
            state.model,
            state.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=to_read["optimizer"],
            options=_OPTIONS,
        )
    else:
        set_model_state_dict(state.model, model_sd, options=_OPTIONS)
