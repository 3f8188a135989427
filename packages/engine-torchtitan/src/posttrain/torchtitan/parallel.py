"""torchtitan's parallelisms applied to the engine's model: activation checkpointing, torch.compile, FSDP2/HSDP.

The order is torchtitan's own (``parallelize_qwen3``): activation checkpointing wraps each block, compile then
compiles each block, FSDP2 shards last (``apply_fsdp_to_decoder``: a unit per block, embeddings + final norm +
output layer as one unit when tied). The device mesh is built here on the compute device (torchtitan's
``ParallelDims`` assumes CUDA for its mesh), 1-D for FSDP or (replicate, shard) for HSDP.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import TorchTitanEngineConfig


def build_mesh(device_type: str, fsdp_size: int) -> Any:
    """1-D ``fsdp`` mesh over all ranks, or (``dp_replicate``, ``fsdp``) when ``0 < fsdp_size < world``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if 0 < fsdp_size < world:
        return init_device_mesh(
            device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("dp_replicate", "fsdp")
        )
    return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every block with torchtitan's ``FullAC`` or ``SelectiveAC``; ``none`` leaves the model as is."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if mode == "full":
        FullAC.Config().build().apply(model)
    elif mode == "selective":
        SelectiveAC.Config().build().apply(model)


def apply_compile(model: nn.Module, world_size: int) -> None:
    """torchtitan's per-block ``torch.compile``."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile as titan_compile

    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world_size)
    titan_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=dims)


def apply_fsdp(model: nn.Module, mesh: Any, cfg: TorchTitanEngineConfig) -> None:
    """torchtitan's ``apply_fsdp_to_decoder``: parameters in ``engine.dtype``, gradients reduced in fp32."""
    from .compat import decoder_fsdp_function

    apply_fsdp_to_decoder = decoder_fsdp_function()
    apply_fsdp_to_decoder(
        model,
        mesh,
        param_dtype=getattr(torch, cfg.dtype),
        reduce_dtype=torch.float32,
        pp_enabled=False,
        reshard_after_forward_policy=cfg.reshard_after_forward,
    )
    # Gradients are the mean over all data-parallel ranks (the loss functions scale by dp_size). gloo has no
    # AVG / PREMUL_SUM reduction: there FSDP sums and divides afterwards.
    from torch.distributed.fsdp import FSDPModule

    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(float(dist.get_world_size()))
            if dist.get_backend() == "gloo":
                sub.set_force_sum_reduction_for_comms(True)


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor on ``device`` (a collective for a sharded DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to(device).full_tensor()
    return t.detach().to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def move_grads(params: list[torch.Tensor], device: torch.device) -> None:
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)


def grad_norm_and_clip(
    params: list[torch.Tensor], max_norm: float, shard_group: Any, device: torch.device
) -> float:
    """Global L2 norm of the gradients (local shards' squares summed over ``shard_group``: HSDP replicas hold
    the same shards); clip to ``max_norm`` when it is > 0."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    total = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        total += torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum().to(device)
    if shard_group is not None:
        dist.all_reduce(total, group=shard_group)
    norm = float(total.sqrt())
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return norm
