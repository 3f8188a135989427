"""FSDP engine checkpoint hooks: one role directory through :mod:`posttrain.ckpt`.

``save_fsdp_checkpoint`` hands the engine's module (FSDP2, FSDP1 or plain), optimizer, LR scheduler and step
counters to :func:`posttrain.ckpt.save_role`, which writes DCP shards keyed by HF parameter names
(``get_state_dict``), per-rank extra state, the ``huggingface/`` directory (config from ``engine.hf_config``,
tokenizer and generation config from the model directory; full safetensors with ``hf_model``) and the
manifest.
``load_fsdp_checkpoint`` restores ``checkpoint.load_contents`` on any number of ranks (``set_state_dict``).
Both are collective: every rank calls them. Retention and the atomic commit belong to the step-level
:class:`posttrain.ckpt.CheckpointManager`.
"""

from __future__ import annotations

from typing import Any

from posttrain.ckpt import AsyncWriter
from posttrain.ckpt.engine_hooks import load_engine_role, prepare_engine_role, save_engine_role


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
    save_engine_role(
        engine, engine.module, engine.layout.backend, local_path, global_step, writer, max_ckpt_to_keep
    )


def prepare_fsdp_checkpoint(engine: Any, role: str, writer: AsyncWriter) -> None:
    """Pin the host buffers of the async saves of ``engine`` into ``<step dir>/<role>`` in the background
    (collective; after the first optimizer step), so the first async save blocks no longer than later ones."""
    prepare_engine_role(engine, engine.module, role, writer)


def load_fsdp_checkpoint(engine: Any, local_path: str, **kwargs: Any) -> dict[str, Any]:
    """Restore ``checkpoint.load_contents`` from the role directory ``local_path`` (collective); a native
    megatron engine checkpoint is refused by name.

    Returns the saved counters (``global_step``, ``skipped_steps``) when extra is loaded, else ``{}``.
    """
    return load_engine_role(engine, engine.module, local_path, "FSDP")
