"""The step machinery shared by the engines that own one ``torch.nn.Module`` (the FSDP and torchtitan
engines).

:func:`ensure_process_group` starts the default group under ``torchrun``. :class:`ModuleEngineMixin` is their
``forward_backward_batch``: the packed batch is split into micro-batches (by token budget with
``use_dynamic_bsz``, else by count), every micro-batch's copy to the device is queued up front (pinned,
asynchronous), each one's per-token outputs (the engine's ``_forward_micro``) go to the loss function with the
step's global token counts (:func:`posttrain.core.batch.loss_context`), and a rank with fewer micro-batches
than another data-parallel rank runs zero-weighted 2-token filler passes, so every rank joins the same number
of FSDP collectives. The outputs come back in batch order on the batch's device; the one host sync is reading
the losses. The mixin also gives ``device`` (the engine's ``_device``) and the train/eval mode hooks.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .batch import (
    LossFn,
    PackedBatch,
    as_floats,
    check_temperatures,
    lockstep_count,
    loss_context,
    make_micro_batches,
    restore_order,
    run_micro_batches,
)


def ensure_process_group() -> bool:
    """Initialise the default group under torchrun (``WORLD_SIZE`` set) if nobody has: NCCL with CUDA, gloo
    without. True when a group exists."""
    if not dist.is_available():
        return False
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.is_initialized()


class ModuleEngineMixin:
    """``forward_backward_batch``, ``device`` and the mode hooks of
    a :class:`~posttrain.core.engine.BaseEngine` over one ``module``; the engine supplies ``_forward_micro``
    (and ``_reshard`` when it shards)."""

    module: torch.nn.Module | None
    _device: torch.device

    @property
    def device(self) -> torch.device:
        return self._device

    def on_mode_enter(self, mode: str) -> None:
        self.module.train(mode == "train")

    def on_mode_exit(self, mode: str) -> None:
        self._reshard()

    def _reshard(self) -> None:
        """Free the parameters FSDP2 still holds gathered once no backward follows (nothing here)."""

    def _forward_micro(self, mb: PackedBatch) -> dict[str, torch.Tensor]:
        """Per-token outputs of one micro-batch (already on the device)."""
        raise NotImplementedError

    def forward_backward_batch(
        self, batch: PackedBatch, loss_fn: LossFn | None, forward_only: bool = False
    ) -> dict[str, Any]:
        if loss_fn is None and not forward_only:
            raise ValueError("forward_backward_batch(forward_only=False) needs a loss_fn")
        cfg = self.engine_config
        max_tokens, per_micro = cfg.micro_batching(forward_only)
        parts = make_micro_batches(
            batch,
            max_tokens=max_tokens,
            micro_batch_size=per_micro,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            # counts are equalised below (core's all-reduce uses a CPU tensor, which NCCL rejects)
            dp_group=None,
        )
        steps = self._lockstep_count(len(parts))
        ctx = loss_context(batch, self.get_data_parallel_group())
        check_temperatures(batch)
        micro_batches = [batch.select(p) for p in parts]
        # every copy queued up front (pinned, asynchronous): nothing in the loop waits for the device
        on_device = [mb.to(self._device, non_blocking=True) for mb in micro_batches]
        # the losses are read once after the loop: no host sync per micro-batch
        forward = lambda i: (on_device[i], self._forward_micro(on_device[i]))  # noqa: E731
        outputs, losses, metrics = run_micro_batches(len(on_device), forward, loss_fn, ctx, forward_only)
        for _ in range(steps - len(micro_batches)):
            self._filler_pass(forward_only)
        if forward_only:
            self._reshard()
        target = batch.input_ids.device
        model_output = {  # queued copies: the one host sync is reading the losses below
            k: restore_order(parts, micro_batches, [o[k] for o in outputs]).to(target, non_blocking=True)
            for k in outputs[0]
        }
        metrics_out = {k: as_floats(v) for k, v in metrics.items()}
        loss = as_floats(losses)
        if target.type == "cpu" and self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()  # the output copies (done by now if read)
        return {"model_output": model_output, "loss": loss, "metrics": metrics_out}

    def _lockstep_count(self, count: int) -> int:
        """The largest micro-batch count over the data-parallel ranks (FSDP needs equal counts; the ranks of a
        tensor-parallel group share theirs)."""
        return lockstep_count(count, self.get_data_parallel_size(), self._device)

    def _filler_pass(self, forward_only: bool) -> None:
        """A 2-token pass with zero weight, so this rank joins the collectives of a micro-batch it lacks."""
        filler = PackedBatch.from_sequences([[0, 0]]).to(self._device)
        out = self._forward_micro(filler)
        if not forward_only:
            (sum(v.sum() for v in out.values()) * 0.0).backward()
