"""torchtitan engine checkpoint hooks: one role directory through :mod:`posttrain.ckpt`, under HF names.

The role's model is the engine's HF-named view (:func:`posttrain.torchtitan.modeling.hf_view`), so the DCP shards,
the optimizer state (``state.<HF name>.exp_avg``) and the ``huggingface/`` export are keyed exactly as the FSDP
engine writes them: a role saved by either engine loads on the other, on any number of ranks. ``config.json`` of
the export is ``model.path``'s with ``model.override_config`` applied. Both calls are collective.
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
        model=engine.hf_module,
        optimizer=engine.optimizer,
        lr_scheduler=engine.lr_scheduler,
        counters={"global_step": global_step, "skipped_steps": engine.skipped_steps},
    )


def _role_info(engine: Any) -> RoleInfo:
    sizes = {"dp": engine.get_data_parallel_size()}
    mesh = engine.device_mesh
    if mesh is not None:
        sizes.update(zip(mesh.mesh_dim_names, mesh.shape))
    return RoleInfo(
        backend="torchtitan",
        parallel_sizes=sizes,
        hf_config=engine.hf_config,
        model_dir=engine.model_config.path,
        tokenizer_dir=engine.model_config.tokenizer_dir,
    )


def save_checkpoint(
    engine: Any,
    local_path: str,
    global_step: int = 0,
    writer: AsyncWriter | None = None,
    max_ckpt_to_keep: int | None = None,
    **kwargs: Any,
) -> None:
    """Write ``checkpoint.save_contents`` into the role directory ``local_path`` (collective); with
    ``checkpoint.async_save`` pass the step manager's ``writer``. ``max_ckpt_to_keep`` (else
    ``checkpoint.max_ckpt_to_keep``) prunes older ``global_step_<N>`` saves of this role."""
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
        _role_state(engine, global_step),
        _role_info(engine),
        list(config.save_contents),
        global_step,
        writer=active,
    )
    keep = max_ckpt_to_keep if max_ckpt_to_keep is not None else config.max_ckpt_to_keep
    retain_role_saves(local_path, keep, lambda d: (Path(d) / ROLE_MANIFEST).is_file(), active)


def prepare_checkpoint(engine: Any, role: str, writer: AsyncWriter) -> None:
    """Allocate the host buffers of the async saves in the background (no-op without async_save)."""
    if engine.checkpoint_config.async_save:
        prepare_role(role, _role_state(engine, 0), list(engine.checkpoint_config.save_contents), writer)


def load_checkpoint(engine: Any, local_path: str, **kwargs: Any) -> dict[str, Any]:
    """Restore ``checkpoint.load_contents`` from ``local_path`` (collective); returns the saved counters."""
    config = engine.checkpoint_config
    engine.engine_config.check_checkpoint(config)
    engine.to(engine.device, model=True, optimizer=True, grad=False)
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
