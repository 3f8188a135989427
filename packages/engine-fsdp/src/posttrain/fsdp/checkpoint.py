"""FSDP engine checkpoint hooks: one role directory through :mod:`posttrain.ckpt`.

``save_fsdp_checkpoint`` hands the engine's module (FSDP2, FSDP1 or plain), optimizer, LR scheduler and step
counters to :func:`posttrain.ckpt.save_role`, which writes DCP shards keyed by HF parameter names
(``get_state_dict``), per-rank extra state, the ``huggingface/`` directory (config from ``engine.hf_config``,
tokenizer and generation config from the model directory; full safetensors with ``hf_model``) and the manifest.
``load_fsdp_checkpoint`` restores ``checkpoint.load_contents`` on any number of ranks (``set_state_dict``).
Both are collective: every rank calls them. Retention and the atomic commit belong to the step-level
:class:`posttrain.ckpt.CheckpointManager`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.ckpt import (
    AsyncWriter,
    RoleInfo,
    RoleState,
    load_role,
    prepare_role,
    retain_role_saves,
    save_role,
)
from posttrain.ckpt.layout import ROLE_MANIFEST


def _role_state(engine: Any, global_step: int) -> RoleState:
    return RoleState(
        model=engine.module,
        optimizer=engine.optimizer,
        lr_scheduler=engine.lr_scheduler,
        counters={"global_step": global_step, "skipped_steps": engine.skipped_steps},
    )


def _role_info(engine: Any) -> RoleInfo:
    mesh = engine.device_mesh
    sizes = {"dp": engine.get_data_parallel_size()}
    if mesh is not None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        sizes.update(zip(names, mesh.shape))
    return RoleInfo(
        backend=engine.layout.backend,
        parallel_sizes=sizes,
        hf_config=engine.hf_config,
        model_dir=engine.model_config.path,
        tokenizer_dir=engine.model_config.tokenizer_dir,
    )


def save_fsdp_checkpoint(
    engine: Any,
    local_path: str,
    global_step: int = 0,
    writer: AsyncWriter | None = None,
    max_ckpt_to_keep: int | None = None,
    **kwargs: Any,
) -> None:
    """Write ``checkpoint.save_contents`` of ``engine`` into the role directory ``local_path`` (collective).

    With ``checkpoint.async_save`` pass the step manager's ``writer``: the call then returns after the
    device-to-host snapshot and the files are written in the background. ``max_ckpt_to_keep`` (else
    ``checkpoint.max_ckpt_to_keep``) prunes older ``global_step_<N>`` siblings once this save is written, when
    ``local_path`` is ``<root>/global_step_<N>/<role>`` (:func:`posttrain.ckpt.retain_role_saves`).
    """
    config = engine.checkpoint_config
    engine.engine_config.check_checkpoint(config)
    if config.async_save and writer is None:
        raise ValueError(
            "checkpoint.async_save=true needs the background writer of the step's "
            "CheckpointManager: call engine.save_checkpoint(path, global_step=..., "
            "writer=manager.writer), or set checkpoint.async_save=false"
        )
    save_role(
        local_path,
        _role_state(engine, global_step),
        _role_info(engine),
        list(config.save_contents),
        global_step,
        writer=writer if config.async_save else None,
    )
    keep = max_ckpt_to_keep if max_ckpt_to_keep is not None else config.max_ckpt_to_keep
    retain_role_saves(local_path, keep, _finished, writer if config.async_save else None)


def _finished(role_dir: Path) -> bool:
    """A role directory whose save got to its last file (the manifest)."""
    return (role_dir / ROLE_MANIFEST).is_file()


def _refuse_native_megatron(role_dir: Path) -> None:
    """A megatron engine role directory in its native layout (Megatron names and shards) has no manifest."""
    if (role_dir / "transformer_config.json").is_file() and not (role_dir / "manifest.json").is_file():
        raise ValueError(
            f"{role_dir} is a native megatron engine checkpoint (Megatron parameter names and shards), which "
            "the FSDP engine cannot read: save it with <role>.engine.portable_checkpoint=true on the megatron "
            "engine (HF names, this engine's layout), or load it on the megatron engine"
        )


def prepare_fsdp_checkpoint(engine: Any, role: str, writer: AsyncWriter) -> None:
    """Pin the host buffers of the async saves of ``engine`` into ``<step dir>/<role>`` in the background
    (collective; after the first optimizer step), so the first async save blocks no longer than later ones."""
    config = engine.checkpoint_config
    if config.async_save:
        prepare_role(role, _role_state(engine, 0), list(config.save_contents), writer)


def load_fsdp_checkpoint(engine: Any, local_path: str, **kwargs: Any) -> dict[str, Any]:
    """Restore ``checkpoint.load_contents`` from the role directory ``local_path`` (collective).

    Returns the saved counters (``global_step``, ``skipped_steps``) when extra is loaded, else ``{}``.
    """
    config = engine.checkpoint_config
    engine.engine_config.check_checkpoint(config)
    _refuse_native_megatron(Path(local_path))
    engine.to(engine.device, model=True, optimizer=True, grad=False)  # load into device-resident state
    try:
        counters = load_role(local_path, _role_state(engine, 0), list(config.load_contents))
    finally:
        engine.to(
            "cpu",
            model=engine.is_param_offload_enabled,
            optimizer=engine.is_optimizer_offload_enabled,
            grad=False,
        )
    engine.skipped_steps = counters.get("skipped_steps", engine.skipped_steps)
    return counters
