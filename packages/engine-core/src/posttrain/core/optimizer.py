"""The optimizer side shared by the engines that own one ``torch.nn.Module`` (the FSDP and torchtitan
engines).

:func:`build_adamw` makes their AdamW and the ``LambdaLR`` schedule that follows
``OptimizerConfig.lr_multiplier``;
:class:`OptimizerMixin` gives such an engine :class:`~posttrain.core.engine.BaseEngine`'s
``optimizer_zero_grad``, ``apply_optimizer_step`` and ``lr_scheduler_step`` over its ``module``, ``optimizer``
and ``lr_scheduler`` attributes. :func:`move_optimizer_state` and :func:`move_grads` are the offload moves,
and
:func:`grad_norm_and_clip` the global gradient norm of sharded parameters.

The gradient norm is computed from each rank's local gradient shards (a DTensor's local tensor): the squared
norms are summed and all-reduced over the shard group only (replicas hold equal shards), so it equals the norm
of the full gradient as long as every parameter is sharded over that one group (no tensor parallelism).
Clipping multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .config import OptimizerConfig


def build_adamw(
    module: torch.nn.Module, optimizer_config: OptimizerConfig, fused: bool
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``module``'s parameters that require grad, with ``optim``'s lr, betas, eps and weight decay
    (torch's fused kernel when ``fused``, else torch's default), and the ``LambdaLR`` schedule of
    ``optim.lr_multiplier``."""
    oc = optimizer_config
    optimizer = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],
        lr=oc.lr,
        betas=tuple(oc.betas),
        eps=oc.eps,
        weight_decay=oc.weight_decay,
        fused=fused or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: oc.lr_multiplier(step))
    return optimizer, scheduler


class OptimizerMixin:
    """``optimizer_zero_grad``, ``apply_optimizer_step`` and ``lr_scheduler_step`` of an engine whose
    ``optimizer`` and ``lr_scheduler`` are a torch optimizer and scheduler (:func:`build_adamw`); on a
    forward-only engine (``optimizer`` None) zeroing the gradients zeroes ``module``'s."""

    module: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any

    def optimizer_zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.module.zero_grad(set_to_none=True)

    def apply_optimizer_step(self) -> None:
        self.optimizer.step()

    def lr_scheduler_step(self) -> float:
        self.lr_scheduler.step()
        return float(self.lr_scheduler.get_last_lr()[0])


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every state tensor but Adam's ``step`` counter (which stays where the optimizer expects it)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


@torch.no_grad()
def move_grads(params: Iterable[torch.Tensor], device: torch.device | str) -> None:
    """Move each parameter's gradient (those that have one) to ``device``."""
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.to(device, non_blocking=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def grad_norm_and_clip(
    params: Iterable[torch.Tensor], max_norm: float, shard_group: Any, comm_device: torch.device
) -> float:
    """Global L2 norm of the gradients (local shards' squares summed over ``shard_group``, on
    ``comm_device``); clip when ``max_norm > 0`` (see the module docstring).

    One ``_foreach_norm`` per (device, dtype) group and one ``_foreach_mul_`` for the clip, so the cost is a
    few kernel launches rather than a few per parameter; the only host sync is reading the norm."""
    grads = [_local(p.grad).detach() for p in params if p.grad is not None]
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=comm_device)
    for group in groups.values():
        norms = torch._foreach_norm(group, 2.0)
        total += torch.stack(norms).float().pow(2).sum().to(comm_device)
    if shard_group is not None:
        dist.all_reduce(total, group=shard_group)
    norm = float(total.sqrt())
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for group in groups.values():
                torch._foreach_mul_(group, coef)
    return norm
