"""The Megatron-Core engine: a ``BaseEngine`` over Megatron-Bridge-built GPT models.

``initialize`` creates Megatron's process groups (TP, PP with VPP, CP, EP/ETP; DP is what is left), builds the
model through Megatron-Bridge from the HF directory, wraps it in Megatron DDP (or Megatron-FSDP) and builds
Megatron's (distributed) Adam. ``forward_backward_batch`` splits a packed batch into micro-batches and runs
them through Megatron's pipeline schedule (no pipelining, 1F1B, or interleaved 1F1B with VPP); each
micro-batch is one THD stream. The last pipeline stage turns the TP-sharded logits into per-token log-probs
(and entropy) and calls the loss function; the schedule divides each micro-batch loss by the number of
micro-batches, so the loss handed back to it is multiplied by that number and the caller's global token
normalisation (:class:`posttrain.core.batch.LossContext`) is what decides the gradient scale. With context
parallelism each CP rank runs its load-balanced chunks of every sequence (:mod:`.context_parallel`); the
per-token outputs are gathered over CP into packed order, so each CP rank calls the loss function on the whole
micro-batch. The schedule multiplies that loss by the CP size and Megatron DDP averages gradients over
data x context parallel ranks, which together leave the gradient of the CP=1 loss. Outputs come back, in the
caller's order, only on ranks where :meth:`is_mp_src_rank_with_outputs` (TP and CP rank 0 of the last stage).
With ``model.lora_rank > 0`` the chunks carry Megatron-Bridge's LoRA (:mod:`.lora`): only the adapters train,
:meth:`disable_adapter` runs the base model, and :meth:`get_per_tensor_param` streams merged weights, the
base, or the adapter under peft's names.
"""

from __future__ import annotations

import contextlib
import functools
from functools import partial
from typing import Any

import torch

from posttrain.core.batch import (
    LossFn,
    PackedBatch,
    as_floats,
    loss_context,
    make_micro_batches,
    partition_by_tokens,
    restore_order,
)
from posttrain.core.determinism import enable_full_determinism
from posttrain.core.engine import BaseEngine, PerTensorParams
from posttrain.core.memory_policy import resolve_gradient_checkpointing

from . import build, checkpoint, offload, rules, vanilla
from .config import McoreEngineConfig
from .context_parallel import CpLayout
from .lora import MegatronLora, rollout_stream
from .packing import PackedInput, pack_micro_batch, token_outputs
from .router_replay import RouterReplay
from .value_head import add_value_head


class MegatronEngine(BaseEngine):
    """Megatron-Core model + optimizer behind the backend-neutral engine interface."""

    is_value_model = False
    supports_router_replay = True
    """Replays recorded MoE routing (R2, R3) through :mod:`.router_replay`."""
    peft_merge = False
    """Default of ``get_per_tensor_param(peft_merge=...)``: stream LoRA merged into the base weights."""

    def initialize(self) -> None:
        cfg = self.engine_config
        if not isinstance(cfg, McoreEngineConfig):
            raise ValueError(
                f"the megatron engine needs a McoreEngineConfig, got {type(cfg).__name__}: set "
                "engine.strategy=megatron"
            )
        on_cuda = torch.cuda.is_available()
        rules.check_engine(cfg, self.checkpoint_config, self.model_config, on_cuda=on_cuda)
        checkpoint.check_hf_save_kwargs(cfg)
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        if cfg.full_determinism:
            enable_full_determinism(cfg.seed)
        build.init_model_parallel(cfg, cfg.seed)
        self.router_replay = RouterReplay(cfg.router_replay, cfg.sequence_parallel)
        self.lora = (
            MegatronLora(self.model_config, value_model=self.is_value_model)
            if self.model_config.lora_rank > 0
            else None
        )
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.model_config = resolve_gradient_checkpointing(self.model_config, cfg, self._device, world)
        self.chunks = self._build_chunks(cfg, on_cuda)
        self.router_replay.attach(self.chunks)
        self._load_initial_weights()
        self.optimizer = None
        self._lr_step = 0
        self._export_tasks: Any = None
        if not cfg.forward_only:
            self.optimizer = build.build_optimizer(self.chunks, self.optimizer_config, cfg)
            self._wire_schedule_hooks()
            self._set_lr()
        self._offload = offload.Offloader(self.chunks, self.optimizer)
        self.apply_offload_config()

    def _build_chunks(self, cfg: McoreEngineConfig, on_cuda: bool) -> list[torch.nn.Module]:
        """Model chunks through Megatron-Bridge, or the deprecated mbridge with ``vanilla_mbridge``."""
        hooks = [functools.partial(add_value_head, seed=cfg.seed)] if self.is_value_model else []
        if self.lora is not None:
            hooks.append(self.lora.apply)  # after the value head, so the head can be left trainable
        path, remote = self.model_config.path, self.model_config.trust_remote_code
        recompute = bool(self.model_config.enable_gradient_checkpointing) and not cfg.forward_only
        if cfg.vanilla_mbridge:
            self.provider = None
            self.bridge = vanilla.VanillaBridge(
                path, cfg, on_cuda=on_cuda, trust_remote_code=remote, recompute=recompute
            )
            return self.bridge.build_model(
                wrap_with_ddp=not cfg.forward_only, on_cuda=on_cuda, value_head=hooks[0] if hooks else None
            )
        self.bridge = build.make_bridge(path, remote)
        self.provider = build.make_provider(
            self.bridge,
            cfg,
            on_cuda=on_cuda,
            router_replay=self.router_replay.enabled,
            value_model=self.is_value_model,
            recompute=recompute,
        )
        return build.build_model(
            self.provider,
            cfg,
            wrap_with_ddp=not cfg.forward_only,
            on_cuda=on_cuda,
            pre_wrap_hook=hooks or None,
        )

    def _load_initial_weights(self) -> None:
        cfg = self.engine_config
        if cfg.use_dist_checkpointing:
            checkpoint.load_model_dist(
                self.chunks, cfg.dist_checkpointing_path, cfg.dist_checkpointing_prefix
            )
            return
        mismatched = ["output_layer.weight"] if self.is_value_model else None
        self.bridge.load_hf_weights(self.chunks, allowed_mismatched_params=mismatched)

    def _wire_schedule_hooks(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        config = build.unwrap(self.chunks[0]).config
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [c.no_sync for c in self.chunks if hasattr(c, "no_sync")]
        if no_sync:
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    # ------------------------------------------------------------------ device and modes
    @property
    def device(self) -> torch.device:
        return self._device

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        self._offload.to(torch.device(device), model=model, optimizer=optimizer, grad=grad)

    def on_mode_enter(self, mode: str) -> None:
        for chunk in self.chunks:
            chunk.train(mode == "train")

    # ------------------------------------------------------------------ compute
    def _micro_batches(self, batch: PackedBatch, forward_only: bool) -> list[list[int]]:
        cfg = self.engine_config
        max_tokens, per_micro = cfg.micro_batching(forward_only)
        parts = make_micro_batches(
            batch, max_tokens=max_tokens, micro_batch_size=per_micro, use_dynamic_bsz=cfg.use_dynamic_bsz
        )
        if cfg.use_dynamic_bsz and self.get_data_parallel_size() > 1:  # same count on every DP rank
            count = torch.tensor([len(parts)], device=self._device)
            torch.distributed.all_reduce(
                count, op=torch.distributed.ReduceOp.MAX, group=self.get_data_parallel_group()
            )
            if int(count) > len(parts):
                parts = partition_by_tokens(batch.seqlens, max_tokens, min_num_bins=int(count))
        if len(self.chunks) > 1:
            group = build.unwrap(self.chunks[0]).config.microbatch_group_size_per_vp_stage
            if len(parts) % group:
                raise ValueError(
                    f"{len(parts)} micro-batches with virtual pipeline stages: the interleaved "
                    f"schedule needs a multiple of {group}; lower max_token_len_per_gpu or "
                    f"micro_batch_size_per_gpu so the batch splits into {group}*k micro-batches"
                )
        return parts

    def forward_backward_batch(
        self, batch: PackedBatch, loss_fn: LossFn | None, forward_only: bool = False
    ) -> dict[str, Any]:
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if loss_fn is None and not forward_only:
            raise ValueError("forward_backward_batch(forward_only=False) needs a loss_fn")
        parts = self._micro_batches(batch, forward_only)
        micro = [batch.select(p).to(self._device, non_blocking=True) for p in parts]  # no wait on the device
        ctx = loss_context(batch, self.get_data_parallel_group())
        collected: list[tuple[dict[str, torch.Tensor], dict[str, Any], torch.Tensor | None]] = []
        step = partial(
            self._forward_step,
            loss_fn=loss_fn,
            ctx=ctx,
            n_micro=len(micro),
            collected=collected,
            calc_entropy=bool(batch.meta.get("calculate_entropy", False)),
        )
        iters = [iter(micro) for _ in self.chunks]
        self.router_replay.begin_pass(forward_only, batch)
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(micro),
            seq_length=max(m.num_tokens for m in micro),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        self.router_replay.end_pass()
        if not mpu.is_pipeline_last_stage(ignore_virtual=True) or not self.is_mp_src_rank_with_outputs():
            return {}
        outputs = [c[0] for c in collected]
        metrics: dict[str, list[Any]] = {}
        for _, mb_metrics, _ in collected:
            for key, value in mb_metrics.items():
                metrics.setdefault(key, []).append(value)
        target = batch.input_ids.device
        model_output = {
            k: restore_order(parts, micro, [o[k] for o in outputs]).to(target) for k in outputs[0]
        }
        # read once, after the schedule: a read per micro-batch would stall the host between its forward and
        # its backward
        losses = as_floats([c[2] for c in collected if c[2] is not None])
        return {
            "model_output": model_output,
            "loss": losses,
            "metrics": {k: as_floats(v) for k, v in metrics.items()},
        }

    def _forward_step(
        self,
        data_iterator: Any,
        model: torch.nn.Module,
        *,
        loss_fn: LossFn | None,
        ctx: Any,
        n_micro: int,
        collected: list,
        calc_entropy: bool,
    ) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        packed = pack_micro_batch(mb, self.engine_config.token_multiple, self._device, self._cp_group())
        self.router_replay.before_micro(mb, packed.input_ids.shape[1])
        output = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,
            packed_seq_params=packed.packed_seq_params,
        )
        routed = self.router_replay.after_forward(packed.input_ids.shape[1])
        if routed is not None:
            mb.meta["recorded_experts"] = routed[: packed.num_tokens].to(torch.int32)
        return output, partial(
            self._loss_func,
            mb=mb,
            packed=packed,
            loss_fn=loss_fn,
            ctx=ctx,
            n_micro=n_micro,
            collected=collected,
            calc_entropy=calc_entropy,
        )

    def _loss_func(
        self,
        output: torch.Tensor,
        *,
        mb: PackedBatch,
        packed: PackedInput,
        loss_fn: LossFn | None,
        ctx: Any,
        n_micro: int,
        collected: list,
        calc_entropy: bool,
    ) -> tuple[torch.Tensor, dict]:
        outs = self._model_outputs(packed.output_rows(output), mb, calc_entropy, packed.cp)
        if "recorded_experts" in mb.meta:
            outs["routed_experts"] = mb.meta["recorded_experts"]
        if loss_fn is None:
            collected.append(({k: v.detach() for k, v in outs.items()}, {}, None))
            return output.sum() * 0.0, {}
        loss, metrics = loss_fn(outs, mb, ctx)
        collected.append(({k: v.detach() for k, v in outs.items()}, dict(metrics or {}), loss.detach()))
        return loss * n_micro, {}

    def _model_outputs(
        self, logits: torch.Tensor, mb: PackedBatch, calc_entropy: bool, cp: CpLayout | None
    ) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as mpu

        tp_rank = mpu.get_tensor_model_parallel_rank()
        vocab_start = tp_rank * logits.size(-1)
        group = mpu.get_tensor_model_parallel_group()
        chunk = self.engine_config.logits_chunk_size(logits.shape[0])
        accuracy = bool(mb.meta.get("calculate_accuracy", False))
        compiled = self.engine_config.use_torch_compile and logits.is_cuda
        return token_outputs(logits, mb, vocab_start, group, calc_entropy, cp, chunk, accuracy, compiled)

    def _cp_group(self) -> Any:
        """Megatron's context-parallel group when CP > 1, else None."""
        from megatron.core import parallel_state as mpu

        return mpu.get_context_parallel_group() if self.engine_config.context_parallel_size > 1 else None

    # ------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self) -> None:
        for chunk in self.chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def clip_grad_norm(self) -> float:
        self._require_optimizer("clip_grad_norm")
        if self.optimizer.prepare_grads():
            return float("inf")
        clip = self.optimizer_config.clip_grad
        chained = getattr(self.optimizer, "chained_optimizers", None)
        if chained and len(chained) > 1 and not self.optimizer.grads_states_parallel_group_is_shared():
            # MoE: dense and expert optimizers reduce grad stats over different groups; clip both by the
            # combined norm (what ChainedOptimizer.step does).
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            norm = self.optimizer.get_grad_norm()
            for sub in chained:
                params = sub.get_parameters()
                if clip > 0 and params:
                    clip_grad_by_total_norm_fp32(params, clip, norm)
            return float(norm)
        norm = self.optimizer.clip_grad_norm(clip) if clip > 0 else self.optimizer.get_grad_norm()
        return float(norm)

    def apply_optimizer_step(self) -> None:
        self._require_optimizer("apply_optimizer_step")
        self.optimizer.step_with_ready_grads()
        self.router_replay.clear()

    def lr_scheduler_step(self) -> float:
        self._require_optimizer("lr_scheduler_step")
        self._lr_step += 1
        return self._set_lr()

    def _set_lr(self) -> float:
        lr = self.optimizer_config.lr * self.optimizer_config.lr_multiplier(self._lr_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise ValueError(
                f"{what} on a forward_only megatron engine: build it with engine.forward_only=false"
            )

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(
        self,
        *,
        base_sync_done: bool = False,
        peft_merge: bool | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> PerTensorParams:
        """Lazy (HF name, full tensor) stream (in ``dtype`` when given) and the peft config or None.

        Without LoRA: every weight. With LoRA and ``peft_merge`` (default :attr:`peft_merge`): base weights
        with the adapter merged. Otherwise the base weights when ``base_sync_done`` is False and only the
        adapter tensors (peft names) when it is True, with the peft config dict. Every rank must consume
        it."""
        if self.is_value_model:
            raise ValueError(
                "get_per_tensor_param on a value model: only policy weights are synced to rollouts"
            )
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if self._export_tasks is None:
            self._export_tasks = self.bridge.get_conversion_tasks(self.chunks)
        merge = self.lora is None or (self.peft_merge if peft_merge is None else peft_merge)
        adapter_only = self.lora is not None and base_sync_done and not merge
        stream = rollout_stream(
            self.bridge, self.chunks, self._export_tasks, merge=merge, adapter_only=adapter_only, dtype=dtype
        )
        return stream, None if merge else self.lora.peft_config()

    def disable_adapter(self) -> contextlib.AbstractContextManager[Any]:
        """Inside the context the model runs as its base model (a LoRA actor is its own reference)."""
        return contextlib.nullcontext() if self.lora is None else self.lora.disable_adapter(self.chunks)

    def save_checkpoint(
        self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        checkpoint.wait_for_pending_save(self)  # a second save waits for the first
        checkpoint.save(self, local_path, global_step, max_ckpt_to_keep, writer=kwargs.get("writer"))

    def load_checkpoint(self, local_path: str, **kwargs: Any) -> dict[str, int]:
        """Restore ``checkpoint.load_contents``; returns the saved counters (``global_step``,
        ``skipped_steps``) when ``extra`` is loaded, else ``{}``."""
        checkpoint.wait_for_pending_save(self)
        return checkpoint.load(self, local_path)

    # ------------------------------------------------------------------ parallel layout
    def get_data_parallel_size(self) -> int:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_rank()

    def get_data_parallel_group(self) -> Any:
        from megatron.core import parallel_state as mpu

        return mpu.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        from megatron.core import parallel_state as mpu

        return (
            mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0
            and mpu.is_pipeline_last_stage(ignore_virtual=True)
        )


class MegatronLanguageModelEngine(MegatronEngine):
    """Causal LM: outputs ``log_probs``, ``entropy`` when ``batch.meta['calculate_entropy']`` and ``correct``
    (1.0 where the token is the argmax of the logits that predict it) when
    ``batch.meta['calculate_accuracy']``."""

    computes_token_accuracy = True


class MegatronValueModelEngine(MegatronEngine):
    """Value model: the output layer is a 1-unit head; ``values[t]`` is the head's output at token t."""

    is_value_model = True

    def _model_outputs(
        self, logits: torch.Tensor, mb: PackedBatch, calc_entropy: bool, cp: CpLayout | None
    ) -> dict[str, torch.Tensor]:
        values = logits[:, 0].float()
        return {"values": values if cp is None else cp.to_packed(values)}
