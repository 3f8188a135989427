"""Megatron-FSDP checkpoints in the ``fsdp_dtensor`` format: torch DCP over DTensor state dicts.

This is the format Megatron-LM and Megatron-Bridge write for ``ckpt_format="fsdp_dtensor"``: the model's state
dict (``state_dict_for_save_checkpoint()`` of the Megatron-FSDP wrapper, one DTensor per parameter, sharded
over the data-parallel ranks) and the distributed optimizer's ``sharded_state_dict`` with
``distrib_optim_sharding_type="fsdp_dtensor"`` (Adam moments keyed by parameter name, DTensors too) go through
the same preprocessing as theirs (SwiGLU ``linear_fc1`` split into ``_w``/``_v``, expert re-indexing, uneven
shard metadata) and into ``torch.distributed.checkpoint``. DCP stores global tensors, so a checkpoint written
at one data-parallel size loads at another. Model and optimizer always come from one state dict (Megatron-FSDP
cannot save or load the optimizer without the model, a rule the config enforces), ``extra`` (LR step, skipped
steps) is stored next to them; loading is strict (a key missing from the checkpoint is an error).

The preprocessing is done here with Megatron-Core's helpers rather than Megatron-Bridge's
``preprocess_fsdp_dtensor_state_dict``: that module imports nvidia-modelopt, which the GPU image lacks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fsdp_dtensor",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
"""What Megatron-Bridge passes to ``optimizer.sharded_state_dict`` for the fsdp_dtensor format."""


def _chunk(engine: Any) -> torch.nn.Module:
    if len(engine.chunks) != 1:
        raise ValueError(
            f"a Megatron-FSDP engine with {len(engine.chunks)} model chunks: Megatron-FSDP checkpoints need "
            "pipeline_model_parallel_size=1 and no virtual pipeline stages"
        )
    return engine.chunks[0]


def _empty_like(param: Any) -> Any:
    from torch.distributed.tensor import DTensor

    local = torch.zeros_like(param.to_local())
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def optimizer_state_dict(chunk: torch.nn.Module, optimizer: Any, is_loading: bool) -> dict[str, Any]:
    """The optimizer's fsdp_dtensor state dict with an entry for every parameter on every rank, sorted by
    name.

    Adam keeps no state for a parameter whose shard on this rank is empty, so ranks list different parameters
    in different orders; the preprocessing runs one collective per parameter, so each rank adds empty
    DTensor moments (and the common step) for the parameters it lacks, and every rank walks them in one order.
    Call after the model's ``state_dict_for_save_checkpoint`` (which puts the DTensor parameters in place).
    """
    optim = optimizer.sharded_state_dict({}, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))
    state = optim["state"]
    step = next((entry["step"] for entry in state.values() if "step" in entry), None)
    full = {}
    for name in sorted(optim["param_to_group_meta"]):
        entry = state.get(name)
        if entry is None:
            param = chunk.get_parameter(name)
            entry = {"exp_avg": _empty_like(param), "exp_avg_sq": _empty_like(param)}
            if step is not None:
                entry["step"] = step.clone()
        full[name] = entry
    return {**optim, "state": full}


def _raw_state(engine: Any, contents: list[str], is_loading: bool) -> dict[str, Any]:
    """Model (always: the optimizer and the preprocessing key off it), optimizer and extra as requested."""
    chunk = _chunk(engine)
    state: dict[str, Any] = {"model": chunk.state_dict_for_save_checkpoint()}
    if "optimizer" in contents and engine.optimizer is not None:
        state["optimizer"] = optimizer_state_dict(chunk, engine.optimizer, is_loading)
    if "extra" in contents:
        state["extra"] = {"lr_step": engine._lr_step, "skipped_steps": engine.skipped_steps}
    return state


def model_key_root(chunk: torch.nn.Module, keys: Iterable[str]) -> torch.nn.Module:
    """The module Megatron-Core's fsdp_dtensor helpers resolve model keys against (``get_parameter("module." +
    key)``). A model key is a GPTModel parameter name under ``d`` prefixes ``module.``: none through the DDP
    wrapper's ``state_dict_for_save_checkpoint``, one through Megatron-FSDP's (its own ``state_dict``), where
    a bf16 model's Float16Module hands up its child's names without a level of its own, so no module of the
    wrapper chain is named as the keys are. The root is ``d + 1`` bare modules nested over the GPTModel; a key
    set in which no key names a GPTModel parameter is a ValueError."""
    from .build import unwrap

    gpt = unwrap(chunk)
    names = {name for name, _ in gpt.named_parameters()}
    keys = list(keys)
    for key in keys:
        name, depth = key, 0
        while name not in names and name.startswith("module."):
            name, depth = name[len("module.") :], depth + 1
        if name in names:
            root = gpt
            for _ in range(depth + 1):
                outer = torch.nn.Module()
                outer.module = root
                root = outer
            return root
    raise ValueError(
        f"no model key names a parameter of the {type(gpt).__name__} inside {type(chunk).__name__} (first "
        f"key: {keys[0] if keys else None!r}): the fsdp_dtensor layout cannot be written. This Megatron-FSDP "
        f"names its state dict in a way posttrain does not know (tested: megatron-fsdp 0.6.1): pin that "
        f"version, or train with engine.use_megatron_fsdp=false, which saves Megatron's torch_dist layout"
    )


def _preprocess(state: dict[str, Any], chunk: torch.nn.Module) -> dict[str, Any]:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` (same keys on save and on load)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer import fsdp_dtensor_checkpoint as fdc
    from megatron.core.utils import get_model_config

    state = dict(state)
    fdc.handle_fp8_extra_state_case(state["model"])
    config = get_model_config(chunk)
    split_fns = [fdc.handle_gdn_in_state_dict] if hasattr(fdc, "handle_gdn_in_state_dict") else []
    if getattr(config, "gated_linear_unit", False):
        split_fns.insert(0, fdc.handle_swiglu_in_state_dict)
    root = model_key_root(chunk, state["model"])
    for split in split_fns:
        state["model"], _ = split(root, state["model"], None)
        # optimizer keys are the wrapper's parameter names: the helper strips one "module." and resolves the
        # rest against the module inside the wrapper
        if state.get("optimizer") is not None:
            _, state["optimizer"] = split(chunk.module, {}, state["optimizer"])
    experts = getattr(config, "num_moe_experts", None)
    if experts:
        state["model"] = fdc.handle_experts_in_state_dict(state["model"], experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def save(engine: Any, contents: list[str], ckpt_dir: Path) -> None:
    """Write ``contents`` (model, optimizer, extra) of a Megatron-FSDP engine to ``ckpt_dir`` (collective)."""
    import torch.distributed.checkpoint as dcp

    state = _preprocess(_raw_state(engine, contents, is_loading=False), _chunk(engine))
    if "model" not in contents:
        state.pop("model")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt_dir)))


def _check_saved(ckpt_dir: Path, contents: list[str]) -> None:
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    tops = {key.split(".", 1)[0] for key in saved}
    missing = [c for c in ("model", "optimizer", "extra") if c in contents and c not in tops]
    if missing:
        raise ValueError(
            f"{str(ckpt_dir)!r} holds {sorted(tops)} but checkpoint.load_contents asks for {missing}: "
            f"remove {missing} from checkpoint.load_contents or load a checkpoint saved with them"
        )


def load(engine: Any, contents: list[str], ckpt_dir: Path) -> dict[str, Any]:
    """Restore ``contents`` of a Megatron-FSDP engine from ``ckpt_dir`` (any data-parallel size).

    Returns the ``extra`` dict when it was loaded, else ``{}``.
    """
    import torch.distributed.checkpoint as dcp

    _check_saved(ckpt_dir, contents)
    chunk = _chunk(engine)
    raw = _raw_state(engine, contents, is_loading=True)
    raw_model, raw_optim = dict(raw["model"]), raw.get("optimizer")
    raw_optim = dict(raw_optim) if raw_optim is not None else None
    state = _preprocess(raw, chunk)  # views into raw's tensors: DCP fills them in place
    if "model" not in contents:
        state.pop("model")
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(str(ckpt_dir)),
        planner=dcp.DefaultLoadPlanner(allow_partial_load=False),
    )
    if "model" in contents:
        chunk.load_state_dict(raw_model, strict=True)
    if raw_optim is not None:
        with torch.no_grad():
            engine.optimizer.load_state_dict(raw_optim)
    return dict(state.get("extra") or {})
