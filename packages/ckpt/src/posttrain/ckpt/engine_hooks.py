"""An engine's checkpoint calls over one role directory, shared by the engines that save HF-named state
(the FSDP and TorchTitan engines).

The engine hands its HF-named model (``model``: the module itself, or a view of it under HF names) with its
optimizer, LR scheduler and step counters to :func:`posttrain.ckpt.save_role`
/ :func:`posttrain.ckpt.load_role`.
The engine provides ``checkpoint_config``, ``engine_config`` (``check_checkpoint``), ``optimizer``,
``lr_scheduler``, ``skipped_steps``, ``device_mesh`` (or None), ``get_data_parallel_size()``, ``hf_config``,
``model_config``, ``device``, ``to(...)`` and the offload flags of :class:`posttrain.core.engine.BaseEngine`.
Every call is collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .hf import HF_LAYOUT
from .layout import ROLE_MANIFEST, read_json
from .retention import retain_role_saves
from .role import RoleInfo, RoleState, load_role, prepare_role, save_role
from .writer import AsyncWriter


def role_state(engine: Any, model: nn.Module, global_step: int) -> RoleState:
    """``model`` with the engine's optimizer, LR scheduler and step counters."""
    return RoleState(
        model=model,
        optimizer=engine.optimizer,
        lr_scheduler=engine.lr_scheduler,
        counters={"global_step": global_step, "skipped_steps": engine.skipped_steps},
    )


def role_info(engine: Any, backend: str) -> RoleInfo:
    """The manifest's facts: ``backend``, the data-parallel size and the device mesh's dims."""
    mesh = engine.device_mesh
    sizes = {"dp": engine.get_data_parallel_size()}
    if mesh is not None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        sizes.update(zip(names, mesh.shape))
    return RoleInfo(
        backend=backend,
        parallel_sizes=sizes,
        hf_config=engine.hf_config,
        model_dir=engine.model_config.path,
        tokenizer_dir=engine.model_config.tokenizer_dir,
    )


def finished(role_dir: Path) -> bool:
    """A role directory whose save got to its last file (the manifest)."""
    return (Path(role_dir) / ROLE_MANIFEST).is_file()


def save_engine_role(
    engine: Any,
    model: nn.Module,
    backend: str,
    local_path: str,
    global_step: int,
    writer: AsyncWriter | None,
    max_ckpt_to_keep: int | None,
) -> None:
    """Write ``checkpoint.save_contents`` into the role directory ``local_path``; with
    ``checkpoint.async_save`` ``writer`` (the step's :class:`~posttrain.ckpt.CheckpointManager` writer) writes
    the files in the background.
    ``max_ckpt_to_keep`` (else ``checkpoint.max_ckpt_to_keep``) prunes older ``global_step_<N>`` saves of the
    role once this one is written (:func:`posttrain.ckpt.retain_role_saves`)."""
    config = engine.checkpoint_config
    engine.engine_config.check_checkpoint(config)
    if config.async_save and writer is None:
        raise ValueError(
            "checkpoint.async_save=true needs the background writer of the step's CheckpointManager: call "
            "engine.save_checkpoint(path, global_step=..., writer=manager.writer), or set "
            "checkpoint.async_save=false"
        )
    active = writer if config.async_save else None
    save_role(
        local_path,
        role_state(engine, model, global_step),
        role_info(engine, backend),
        list(config.save_contents),
        global_step,
        writer=active,
    )
    keep = max_ckpt_to_keep if max_ckpt_to_keep is not None else config.max_ckpt_to_keep
    retain_role_saves(local_path, keep, finished, active)


def prepare_engine_role(engine: Any, model: nn.Module, role: str, writer: AsyncWriter) -> None:
    """Pin the host buffers of the async saves in the background (no-op without ``checkpoint.async_save``)."""
    config = engine.checkpoint_config
    if config.async_save:
        prepare_role(role, role_state(engine, model, 0), list(config.save_contents), writer)


def refuse_native_megatron(role_dir: Path, engine_name: str) -> None:
    """Refuse a megatron engine role directory in its native layout (Megatron names and shards): its manifest
    names another layout than the HF-named one (or it has none: saved before native saves wrote one)."""
    role_dir = Path(role_dir)
    layout = (read_json(role_dir / ROLE_MANIFEST) or {}).get("layout")
    if (role_dir / "transformer_config.json").is_file() and layout != HF_LAYOUT:
        raise ValueError(
            f"{role_dir} is a native megatron engine checkpoint (Megatron parameter names and shards), which "
            f"the {engine_name} engine cannot read: save it with <role>.engine.portable_checkpoint=true on "
            "the megatron engine (HF names, this engine's layout), or load it on the megatron engine"
        )


def load_engine_role(engine: Any, model: nn.Module, local_path: str, engine_name: str) -> dict[str, Any]:
    """Restore ``checkpoint.load_contents`` from ``local_path`` into device-resident state (offloaded again
    after); returns the saved counters (``global_step``, ``skipped_steps``) when ``extra`` is loaded, else
    ``{}``."""
    config = engine.checkpoint_config
    engine.engine_config.check_checkpoint(config)
    refuse_native_megatron(Path(local_path), engine_name)
    engine.to(engine.device, model=True, optimizer=True, grad=False)
    try:
        counters = load_role(local_path, role_state(engine, model, 0), list(config.load_contents))
    finally:
        engine.to(
            "cpu",
            model=engine.is_param_offload_enabled,
            optimizer=engine.is_optimizer_offload_enabled,
            grad=False,
        )
    engine.skipped_steps = counters.get("skipped_steps", engine.skipped_steps)
    return counters
