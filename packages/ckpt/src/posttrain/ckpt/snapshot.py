"""Device-to-host snapshot of a state dict, the only part of an async save that blocks training.

Each tensor (or each DTensor's local shard) is copied into a host buffer that is kept between saves, so only
the first async save pays for allocating (and, for CUDA sources, page-locking: :mod:`posttrain.ckpt.pinned`)
host memory; later saves are one ``copy_(non_blocking=True)`` per tensor and one synchronisation. DTensors
keep their spec (mesh, placements, global shape) around the host shard, so DCP still writes each rank's shard
with its global offsets.

:func:`buffer_plan` and :func:`allocate_buffers` split the allocation off: the plan (key path, local shape,
dtype, pinned or not, DTensor spec) is read from the live state without copying, and the buffers can then be
allocated on another thread before the first save (``AsyncWriter.prepare``). A snapshot reuses a buffer only
when its shape, dtype (and DTensor spec) still match, and allocates a new one otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .pinned import host_empty


def _pin_device(t: torch.Tensor) -> int | None:
    """The CUDA device index of ``t`` (its host buffer is page-locked), or None."""
    if t.device.type != "cuda":
        return None
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def snapshot_to_host(state: Any, buffers: dict[str, Any], prefix: str = "") -> Any:
    """Copy of ``state`` (nested dicts/lists of tensors, DTensors and plain values) with host tensors.

    ``buffers`` maps a key path to the host tensor (or host DTensor) reused across calls.
    """
    out = _copy(state, buffers, prefix)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


def _copy(obj: Any, buffers: dict[str, Any], path: str) -> Any:
    if isinstance(obj, DTensor):
        return _copy_dtensor(obj, buffers, path)
    if isinstance(obj, torch.Tensor):
        host = _host_buffer(obj, buffers, path)
        host.copy_(obj.detach(), non_blocking=obj.device.type == "cuda")
        return host
    if isinstance(obj, dict):
        return {k: _copy(v, buffers, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v, buffers, f"{path}.{i}") for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _host_buffer(src: torch.Tensor, buffers: dict[str, Any], path: str) -> torch.Tensor:
    buf = buffers.get(path)
    if (
        isinstance(buf, torch.Tensor)
        and not isinstance(buf, DTensor)
        and buf.shape == src.shape
        and buf.dtype == src.dtype
    ):
        return buf
    buf = host_empty(src.shape, src.dtype, _pin_device(src))
    buffers[path] = buf
    return buf


def _copy_dtensor(src: DTensor, buffers: dict[str, Any], path: str) -> DTensor:
    local = src.to_local()
    buf = buffers.get(path)
    if not (
        isinstance(buf, DTensor)
        and buf._local_tensor.shape == local.shape
        and buf.dtype == src.dtype
        and buf._spec == src._spec
    ):
        host = host_empty(local.shape, local.dtype, _pin_device(local))
        buf = DTensor(host, src._spec, requires_grad=False)
        buffers[path] = buf
    buf._local_tensor.copy_(local.detach(), non_blocking=local.device.type == "cuda")
    return buf


@dataclass(frozen=True)
class BufferSpec:
    """One host buffer a snapshot of the planned state needs."""

    path: str
    """Key path of the tensor in the state (the key of :func:`snapshot_to_host`'s ``buffers``)."""
    shape: torch.Size
    """Shape of the tensor, or of the DTensor's local shard."""
    dtype: torch.dtype
    """Element type."""
    pin_device: int | None
    """The CUDA device of the source, whose buffer is page-locked; None for a host source."""
    dtensor_spec: Any = None
    """The DTensor's spec (mesh, placements, global shape) or None for a plain tensor."""


def buffer_plan(state: Any, prefix: str = "") -> list[BufferSpec]:
    """The host buffers :func:`snapshot_to_host` of ``state`` under ``prefix`` uses (no copy, no
    allocation)."""
    if isinstance(state, DTensor):
        local = state._local_tensor
        return [BufferSpec(prefix, local.shape, local.dtype, _pin_device(local), state._spec)]
    if isinstance(state, torch.Tensor):
        return [BufferSpec(prefix, state.shape, state.dtype, _pin_device(state))]
    if isinstance(state, dict):
        return [b for k, v in state.items() for b in buffer_plan(v, f"{prefix}.{k}")]
    if isinstance(state, (list, tuple)):
        return [b for i, v in enumerate(state) for b in buffer_plan(v, f"{prefix}.{i}")]
    return []


def allocate_buffers(plan: list[BufferSpec]) -> dict[str, Any]:
    """Host buffers for ``plan``, keyed by path; every page is written once, so the first copy into them does
    not page-fault (:func:`posttrain.ckpt.pinned.host_empty` does it for the pinned ones)."""
    out: dict[str, Any] = {}
    for spec in plan:
        host = host_empty(spec.shape, spec.dtype, spec.pin_device)
        if spec.pin_device is None:
            host.zero_()
        out[spec.path] = (
            host if spec.dtensor_spec is None else DTensor(host, spec.dtensor_spec, requires_grad=False)
        )
    return out
