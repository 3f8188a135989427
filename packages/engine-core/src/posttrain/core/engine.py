"""BaseEngine: the contract a training backend implements (the shape of verl's ``BaseEngine``).

An engine owns one model (plus its optimizer, LR scheduler and checkpoint hooks) sharded its own way. Callers
never touch parameters: they hand it packed batches and a loss function, ask it for an optimizer step, and ask
it for a stream of full HF-named tensors when the rollout needs new weights.
``train_mode()`` / ``eval_mode()`` move what the offload flags say onto the device on entry and back on exit.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from .batch import LossFn, PackedBatch
from .config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig
from .config.engine import resolve_compute_dtype

PerTensorParams = tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None]
"""(lazy stream of (HF name, full tensor), peft config dict or None)."""


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row were skipped for a non-finite gradient norm."""


class EngineModeCtx:
    """Load on enter, offload on exit, for ``mode`` in {train, eval}."""

    def __init__(self, engine: BaseEngine, mode: str, disable_auto_offload: bool = False) -> None:
        if mode not in ("train", "eval"):
            raise ValueError(f"engine mode {mode!r}: use train or eval")
        self.engine, self.mode, self.disable_auto_offload = engine, mode, disable_auto_offload

    def __enter__(self) -> BaseEngine:
        if not self.disable_auto_offload:
            training = self.mode == "train"
            self.engine.to(self.engine.device, model=True, optimizer=training, grad=training)
        self.engine.mode = self.mode
        self.engine.on_mode_enter(self.mode)
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.on_mode_exit(self.mode)
        if self.mode == "train":
            self.engine.optimizer_zero_grad()
        if not self.disable_auto_offload:
            self.engine.to(
                "cpu",
                model=self.engine.is_param_offload_enabled,
                optimizer=self.engine.is_optimizer_offload_enabled and self.mode == "train",
                grad=self.engine.is_param_offload_enabled and self.mode == "train",
            )
        self.engine.mode = None


class BaseEngine(ABC):
    """One model, its optimizer and schedule, behind a backend-neutral interface."""

    supports_router_replay: bool = False
    """Whether the engine replays recorded MoE routing (``engine.router_replay.mode`` R2 or R3); the trainers
    read it from the class, before building anything."""

    computes_token_accuracy: bool = False
    """Whether a forward with ``batch.meta['calculate_accuracy']`` returns ``correct`` per token (1.0 where
    the token is the argmax of the logits that predict it, 0.0 elsewhere and at each sequence's first token);
    SFT reads it from the class to show ``train/token_accuracy``."""

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        optimizer_config: OptimizerConfig,
        checkpoint_config: CheckpointConfig,
    ) -> None:
        resolve_compute_dtype(engine_config)
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode: str | None = None
        self.skipped_steps = 0
        self.skipped_in_a_row = 0

    # ------------------------------------------------------------------ lifecycle
    @abstractmethod
    def initialize(self) -> None:
        """Build the model, optimizer, LR scheduler and checkpoint hooks, then apply the offload config."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device compute runs on."""

    @property
    def is_param_offload_enabled(self) -> bool:
        """``engine.param_offload``: parameters go to the CPU outside train/eval contexts."""
        return self.engine_config.param_offload

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        """``engine.optimizer_offload``: optimizer state goes to the CPU outside the train context."""
        return self.engine_config.optimizer_offload

    def apply_offload_config(self) -> None:
        """End of :meth:`initialize`: move to the CPU what ``param_offload``, ``optimizer_offload`` and
        ``grad_offload`` ask for."""
        cfg = self.engine_config
        if cfg.param_offload is None:
            raise ValueError(
                "engine.param_offload=null (choose) is resolved by the RL trainer for ref.engine only: set "
                "it to true or false for this engine"
            )
        if cfg.param_offload or cfg.optimizer_offload or cfg.grad_offload:
            self.to("cpu", model=cfg.param_offload, optimizer=cfg.optimizer_offload, grad=cfg.grad_offload)

    def train_mode(self, **kwargs: Any) -> EngineModeCtx:
        """Context: model, optimizer and grads on the device; zero grads and offload on exit."""
        return EngineModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs: Any) -> EngineModeCtx:
        """Context: model on the device for forward-only work."""
        return EngineModeCtx(self, "eval", **kwargs)

    def on_mode_enter(self, mode: str) -> None:
        """Backend hook run after loading (e.g. ``module.train()``)."""

    def on_mode_exit(self, mode: str) -> None:
        """Backend hook run before offloading (e.g. reshard)."""

    @abstractmethod
    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """Move model / optimizer state / grads to ``device`` regardless of the offload config."""

    # ------------------------------------------------------------------ compute
    @abstractmethod
    def forward_backward_batch(
        self, batch: PackedBatch, loss_fn: LossFn | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """Run the batch in micro-batches; backward too unless ``forward_only``.

        Returns ``{"model_output": {name: (T,) tensor in batch order}, "loss": [per micro-batch], "metrics":
        {...}}``; on ranks where :meth:`is_mp_src_rank_with_outputs` is False it may return ``{}``."""

    @abstractmethod
    def optimizer_zero_grad(self) -> None: ...

    @abstractmethod
    def clip_grad_norm(self) -> float:
        """Clip gradients to ``optimizer_config.clip_grad`` and return the global norm before clipping."""

    @abstractmethod
    def apply_optimizer_step(self) -> None:
        """Apply the optimizer update with the current gradients."""

    def optimizer_step(self) -> float:
        """Clip, then step unless the norm is non-finite (the step is skipped and counted). Returns the norm.

        ``optim.max_skipped_steps_in_a_row`` skipped steps in a row raise :class:`NonFiniteTrainingError`
        naming the first non-finite gradient or weight of this rank (before anything is saved)."""
        grad_norm = self.clip_grad_norm()
        if math.isfinite(grad_norm):
            self.apply_optimizer_step()
            self.skipped_in_a_row = 0
            return grad_norm
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        limit = self.optimizer_config.max_skipped_steps_in_a_row
        if limit and self.skipped_in_a_row >= limit:
            first = self.first_non_finite()
            raise NonFiniteTrainingError(
                f"{self.skipped_in_a_row} optimizer steps in a row had a non-finite gradient norm "
                f"({grad_norm}); first non-finite tensor on this rank: "
                f"{first or 'none found here (another rank holds it)'}. The run stops here, before anything "
                "non-finite is saved: lower optim.lr, check the data of these steps, and resume from the "
                "last checkpoint (optim.max_skipped_steps_in_a_row sets how many skipped steps in a row are "
                "tolerated)"
            )
        return grad_norm

    def first_non_finite(self) -> str | None:
        """``weight <name>`` or ``gradient of <name>``: the first parameter of ``self.module`` (this rank's
        shard) holding NaN or inf; None when there is none or the engine has no ``module``."""
        module = getattr(self, "module", None)
        if module is None:
            return None
        for name, p in module.named_parameters():
            for what, t in (("weight", p), ("gradient of", p.grad)):
                if t is None:
                    continue
                local = t.to_local() if hasattr(t, "to_local") else t
                if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                    return f"{what} {name}"
        return None

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the schedule one step and return the learning rate now in force."""

    def train_batch(self, batch: PackedBatch, loss_fn: LossFn) -> dict[str, Any]:
        """zero_grad -> forward_backward_batch -> optimizer_step; adds ``grad_norm`` to the metrics."""
        self.optimizer_zero_grad()
        out = self.forward_backward_batch(batch, loss_fn, forward_only=False)
        grad_norm = self.optimizer_step()
        if self.is_mp_src_rank_with_outputs():
            out.setdefault("metrics", {})["grad_norm"] = grad_norm
            out["metrics"]["skipped_step"] = 0.0 if math.isfinite(grad_norm) else 1.0
        return out

    def infer_batch(self, batch: PackedBatch, loss_fn: LossFn | None = None) -> dict[str, Any]:
        """Forward only, no autograd graph."""
        with torch.no_grad():
            return self.forward_backward_batch(batch, loss_fn, forward_only=True)

    # ------------------------------------------------------------------ weights and checkpoints
    @abstractmethod
    def get_per_tensor_param(
        self,
        *,
        base_sync_done: bool = False,
        peft_merge: bool | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> PerTensorParams:
        """Lazy stream of full, HF-named tensors for the rollout, and the peft config (LoRA) or None.

        ``dtype``: cast each tensor to it (None: as stored). Without LoRA: every weight, peft config None.
        With LoRA and ``peft_merge`` (None: the engine's ``peft_merge`` attribute): base weights with the
        adapter merged, peft config None; otherwise the base weights when ``base_sync_done`` is False and only
        the adapter tensors (peft names) when it is True, with the peft config dict. Every rank must consume
        the stream. A yielded tensor must not be overwritten by the stream afterwards (a fresh tensor or a
        view of the stored weight, not a reused staging buffer): the weight sync's sender holds up to
        ``copy_group_bytes`` of them before it copies them into a bucket."""

    @abstractmethod
    def save_checkpoint(
        self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None, **kwargs: Any
    ) -> None: ...

    @abstractmethod
    def load_checkpoint(self, local_path: str, **kwargs: Any) -> dict[str, Any]:
        """Restore ``checkpoint.load_contents`` from the role directory ``local_path`` (collective); return
        the saved step counters (``global_step``, ``skipped_steps``) when ``extra`` is loaded, else ``{}``."""

    def prepare_checkpoint(self, role: str, writer: Any) -> None:
        """Start allocating, in the background, the host buffers of this role's future async saves into
        ``<step dir>/<role>`` (collective; call after the first optimizer step). Engines whose async save
        stages nothing on the host keep this default, which does nothing."""

    # ------------------------------------------------------------------ parallel layout
    @abstractmethod
    def get_data_parallel_size(self) -> int: ...

    @abstractmethod
    def get_data_parallel_rank(self) -> int: ...

    @abstractmethod
    def get_data_parallel_group(self) -> Any: ...

    @abstractmethod
    def is_mp_src_rank_with_outputs(self) -> bool:
        """True on the rank of each model-parallel group whose outputs the caller should collect."""

    def disable_adapter(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which a LoRA model runs as its base model (so the actor serves as reference)."""
        return contextlib.nullcontext()
