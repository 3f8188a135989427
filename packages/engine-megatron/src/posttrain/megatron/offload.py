"""Move a Megatron model's parameter / gradient buffers and its optimizer state between host and device.

Megatron DDP keeps every parameter and gradient as a view into a few contiguous buffers
(``model.buffers[i].param_data`` / ``grad_data``). Offloading copies a buffer to host memory and shrinks its
device storage to zero bytes, which keeps every view valid; loading grows the storage back and copies the host
copy in. Chunks without DDP buffers (forward-only) move parameter by parameter. Optimizer state (Adam moments,
fp32 master weights) moves tensor by tensor.
"""

from __future__ import annotations

from typing import Any

import torch


def _buffers(chunk: torch.nn.Module) -> list[Any]:
    """Megatron DDP's flat param/grad buffers (``buffers`` is a plain method on other modules)."""
    out: list[Any] = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            out.extend(value)
    return out


def _move_flat(t: torch.Tensor, device: torch.device, holder: dict[int, torch.Tensor]) -> None:
    """Offload/load a flat buffer in place, keeping the views into its storage valid."""
    if device.type == "cpu":
        if t.untyped_storage().size() == 0:
            return
        holder[id(t)] = t.detach().to("cpu", copy=True)
        t.untyped_storage().resize_(0)
    elif id(t) in holder:
        host = holder.pop(id(t))
        t.untyped_storage().resize_(host.numel() * host.element_size())
        t.copy_(host, non_blocking=True)


class Offloader:
    """Tracks where model, grads and optimizer state are, and moves them on request."""

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any) -> None:
        self.chunks, self.optimizer = chunks, optimizer
        self._host: dict[int, torch.Tensor] = {}

    def to(self, device: torch.device, *, model: bool, optimizer: bool, grad: bool) -> None:
        compute = next(self.chunks[0].parameters()).device if self._host == {} else None
        if device.type == "cpu" and compute is not None and compute.type == "cpu":
            return
        with torch.no_grad():
            for chunk in self.chunks:
                buffers = _buffers(chunk)
                if not buffers and model:  # parameter by parameter: Module.to would swap DTensor params
                    for p in chunk.parameters():
                        if p.device != device:
                            p.data = p.data.to(device)
                for buf in buffers:
                    if model:
                        _move_flat(buf.param_data, device, self._host)
                    if grad and buf.grad_data is not None:
                        _move_flat(buf.grad_data, device, self._host)
            if optimizer and self.optimizer is not None:
                self._move_optimizer(device)

    def _move_optimizer(self, device: torch.device) -> None:
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in inner:
            torch_opt = getattr(opt, "optimizer", None)
            if torch_opt is None:
                continue
            for state in torch_opt.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        state[key] = value.to(device, non_blocking=True)
            for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
                for p in group:
                    p.data = p.data.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
