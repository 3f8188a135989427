"""torchtitan's parallelisms applied to the engine's model: TP, activation checkpointing, torch.compile,
FSDP2/HSDP.

The order is torchtitan's own (``parallelize_qwen3``): tensor parallelism (``model.parallelize`` with the
placements the model config carries), then activation checkpointing wraps each block, compile then compiles
each block, FSDP2 shards last (``apply_fsdp_to_decoder``: a unit per block, embeddings + final norm + output
layer as one unit when tied). The meshes are torchtitan's ``ParallelDims`` (its DTensor backend,
``partial_dtensor``), built on the compute device: torchtitan picks its mesh device once at import (CUDA when
no accelerator is found), so :func:`build_parallel_dims` names the device for the time of the build.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import TorchTitanEngineConfig


def build_parallel_dims(device_type: str, cfg: TorchTitanEngineConfig) -> Any:
    """torchtitan's ``ParallelDims`` over all ranks with its meshes built: ``tp`` groups of ``tp_size``
    consecutive ranks, the rest data parallel (``fsdp``, or ``dp_replicate`` x ``fsdp`` when
    ``0 < fsdp_size <`` the data-parallel size)."""
    import torchtitan.distributed.parallel_dims as titan_dims

    world = dist.get_world_size()
    dp = cfg.check_world_size(world)
    shard = cfg.fsdp_size if 0 < cfg.fsdp_size < dp else dp
    dims = titan_dims.ParallelDims(
        dp_replicate=dp // shard,
        dp_shard=shard,
        cp=1,
        tp=cfg.tp_size,
        pp=1,
        ep=cfg.ep_size,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    chosen, titan_dims.device_type = titan_dims.device_type, device_type
    try:
        dims.build_mesh()
    finally:
        titan_dims.device_type = chosen
    if cfg.ep_size > 1:
        # torchtitan's runtime helpers (the EP token dispatcher) read a process-wide backend, "spmd_types"
        # unless set: make it the meshes' (torchtitan's trainer does the same).
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend(dims.spmd_backend)
    return dims


def dp_mesh(dims: Any) -> Any:
    """The data-parallel mesh FSDP2 shards over: ``fsdp``, or (``dp_replicate``, ``fsdp``) for HSDP."""
    return dims.get_mesh(["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"])


def apply_tensor_parallel(model: nn.Module, dims: Any) -> None:
    """torchtitan's TP / EP: every module's parameters distributed and its forward wrapped by the placements
    its config carries (``modeling.titan_model_config`` with ``tp_size`` or ``ep_size``)."""
    if dims.tp_enabled or dims.ep_enabled:
        model.parallelize(dims)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every block with torchtitan's ``FullAC`` or ``SelectiveAC``; ``none`` leaves the model as is."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if mode == "full":
        FullAC.Config().build().apply(model)
    elif mode == "selective":
        SelectiveAC.Config().build().apply(model)


def apply_compile(model: nn.Module, dims: Any) -> None:
    """torchtitan's per-block ``torch.compile`` (``dims``: the engine's ``ParallelDims``, or None in one
    process)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile as titan_compile

    if dims is None:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    titan_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=dims)


def apply_fsdp(model: nn.Module, dims: Any, cfg: TorchTitanEngineConfig) -> None:
    """torchtitan's ``apply_fsdp_to_decoder`` over the data-parallel mesh (posttrain's equivalent on a torch
    without it: ``compat``): parameters in ``engine.dtype``, gradients reduced in fp32 and divided by the
    data-parallel size."""
    from .compat import decoder_fsdp_function

    apply_fsdp_to_decoder = decoder_fsdp_function()
    mesh = dp_mesh(dims)
    expert = {}
    if dims.ep_enabled:  # expert weights FSDP-sharded over efsdp (the shard group / ep_size)
        names = ["dp_replicate", "efsdp"] if dims.dp_replicate_enabled else ["efsdp"]
        expert = {"ep_degree": dims.ep, "edp_mesh": dims.get_optional_mesh(names)}
    apply_fsdp_to_decoder(
        model,
        mesh,
        param_dtype=getattr(torch, cfg.dtype),
        reduce_dtype=torch.float32,
        pp_enabled=False,
        reshard_after_forward_policy=cfg.reshard_after_forward,
        **expert,
    )
    # Gradients are the mean over all data-parallel ranks (the loss functions scale by dp_size). gloo has no
    # AVG / PREMUL_SUM reduction: there FSDP sums and divides afterwards.
    from torch.distributed.fsdp import FSDPModule

    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(float(mesh.size()))
            if dist.get_backend() == "gloo":
                sub.set_force_sum_reduction_for_comms(True)
                _plain_single_rank_reduce(sub)


def _plain_single_rank_reduce(module: Any) -> None:
    """Under forced SUM, torch's FSDP2 divides the gradients of a one-rank shard group by the factor twice
    (its single-rank copy divides, then the post-division runs): give such groups (EP's expert shards when
    ``ep_size`` is the whole shard group) the plain path, which has no collective to force and divides
    once."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        if group.mesh_info.mesh.size() == 1:
            group.force_sum_reduction_for_comms = False


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor on ``device`` (a collective for a sharded DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to(device).full_tensor()
    return t.detach().to(device)


def dtensor_grad_norm_and_clip(params: list[torch.Tensor], max_norm: float) -> float:
    """Global L2 norm of DTensor gradients on several meshes (TP-sharded and TP-replicated ones): torchtitan's
    ``clip_grad_norm_``, which reduces each DTensor's norm over its own placements; clip when
    ``max_norm > 0``."""
    from torchtitan.distributed.utils import clip_grad_norm_

    norm = clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return float(norm)
