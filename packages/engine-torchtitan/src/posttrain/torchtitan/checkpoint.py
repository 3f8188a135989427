"""torchtitan engine checkpoint hooks: one role directory through :mod:`posttrain.ckpt`, under HF names.

The role's model is the engine's HF-named view (:func:`posttrain.torchtitan.modeling.hf_view`), so the DCP shards,
the optimizer state (``state.<HF name>.exp_avg``) and the ``huggingface/`` export are keyed exactly as the FSDP
engine writes them: a role saved by either engine loads on the other, on any number of ranks. ``config.json`` of
the export is ``model.path``'s with ``model.override_config`` applied. Both calls are collective.
"""

from __future__ import annotations

from typing import Any

from posttrain.ckpt import AsyncWriter
from posttrain.ckpt.engine_hooks import load_engine_role, prepare_engine_role, save_engine_role


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
    save_engine_role(
        engine, engine.hf_module, "torchtitan", local_path, global_step, writer, max_ckpt_to_keep
    )


def prepare_checkpoint(engine: Any, role: str, writer: AsyncWriter) -> None:
    """Allocate the host buffers of the async saves in the background (no-op without async_save)."""
    prepare_engine_role(engine, engine.hf_module, role, writer)


def load_checkpoint(engine: Any, local_path: str, **kwargs: Any) -> dict[str, Any]:
    """Restore ``checkpoint.load_contents`` from ``local_path`` (collective); returns the saved counters. A
    native megatron engine checkpoint is refused by name."""
    return load_engine_role(engine, engine.hf_module, local_path, "torchtitan")
