"""torchtitan engine checkpoint hooks: one role directory through :mod:`posttrain.ckpt`, under HF names.

The role's model is the engine's HF-named view (:func:`posttrain.torchtitan.modeling.hf_view`), so the DCP
shards, the optimizer state (``state.<HF name>.exp_avg``) and the ``huggingface/`` export are keyed exactly as
the FSDP engine writes them: a role saved by either engine loads on the other, on any number of ranks.
``config.json`` of the export is ``model.path``'s with ``model.override_config`` applied. Both calls are
collective.

A Qwen3-MoE model is the exception: its experts are saved as torchtitan's grouped tensors
(``mlp.experts.w1_EFD``, ...), so such a role resumes on the torchtitan engine only (on any number of ranks;
another backend's MoE role is refused by name on load), and ``hf_model`` is refused for it
(:func:`check_moe_contents`; the rollout's weight stream is per-expert HF).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.ckpt import AsyncWriter
from posttrain.ckpt.engine_hooks import load_engine_role, prepare_engine_role, save_engine_role
from posttrain.ckpt.layout import ROLE_MANIFEST, read_json


def check_moe_contents(save_contents: list[str]) -> None:
    """Refuse ``hf_model`` for a MoE model (its export would hold grouped expert tensors HF cannot load)."""
    if "hf_model" in save_contents:
        raise ValueError(
            "checkpoint.save_contents has hf_model, which the torchtitan engine does not write for a MoE "
            "model (its checkpoints hold torchtitan's grouped expert tensors): drop hf_model from "
            "checkpoint.save_contents (e.g. checkpoint.save_contents=[model,optimizer,extra])"
        )


def refuse_other_moe_role(local_path: str) -> None:
    """Refuse a MoE role another backend saved (different expert tensors), naming the backend."""
    backend = (read_json(Path(local_path) / ROLE_MANIFEST) or {}).get("backend", "torchtitan")
    if backend != "torchtitan":
        engine = "megatron" if backend == "megatron" else "fsdp2"  # fsdp, fsdp2 and torch: the FSDP engine
        raise ValueError(
            f"{local_path} was saved by backend {backend!r}: a MoE model's checkpoint resumes on the engine "
            "that wrote it (the torchtitan engine keeps grouped expert tensors); load it with "
            f"model_engine={engine}"
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
    if engine.is_moe:
        check_moe_contents(list(engine.checkpoint_config.save_contents))
    save_engine_role(
        engine, engine.hf_module, "torchtitan", local_path, global_step, writer, max_ckpt_to_keep
    )


def prepare_checkpoint(engine: Any, role: str, writer: AsyncWriter) -> None:
    """Allocate the host buffers of the async saves in the background (no-op without async_save)."""
    prepare_engine_role(engine, engine.hf_module, role, writer)


def load_checkpoint(engine: Any, local_path: str, **kwargs: Any) -> dict[str, Any]:
    """Restore ``checkpoint.load_contents`` from ``local_path`` (collective); returns the saved counters. A
    native megatron engine checkpoint is refused by name."""
    if engine.is_moe:
        refuse_other_moe_role(local_path)
    return load_engine_role(engine, engine.hf_module, local_path, "torchtitan")
