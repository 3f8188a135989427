"""FSDP2 / FSDP1 engines over Hugging Face models: a causal LM and a value model (one-label token classifier).

Layout. Under ``torchrun`` (``WORLD_SIZE`` set) the engine initialises the default process group if the caller
has not (NCCL on CUDA, gloo on CPU) and shards with FSDP2 (``FSDP2EngineConfig``) or FSDP1
(``FSDP1EngineConfig``) over all ranks, or HSDP when ``0 < fsdp_size < world``; every rank is a data-parallel
rank. In a plain process with no process group (a world of 1) it runs the unwrapped module (autocast to
``dtype`` when that differs from ``model_dtype``). Each layout is a class in :mod:`.layout`, chosen once
in :meth:`FSDPEngine.initialize`.

A step. ``forward_backward_batch`` splits the packed batch into micro-batches (by token budget with
``use_dynamic_bsz``, else by count), runs every rank through the same number of them (a rank with fewer runs
zero-weighted 2-token filler passes so FSDP's collectives line up), and hands each micro-batch's outputs to
the loss function with the step's global token counts (:func:`posttrain.core.loss_context`). The model sees
one packed row per micro-batch (:mod:`posttrain.fsdp.inputs`); the causal LM's head returns next-token
log-probs (and entropy on request) chunk by chunk (:mod:`posttrain.fsdp.logprobs`), aligned so
``log_probs[t]`` scores token ``t``. ``optimizer_step`` clips to ``clip_grad`` and skips the update on a
non-finite norm; the LR follows ``OptimizerConfig.lr_multiplier`` through ``LambdaLR``.

Offload. ``to(device, model, optimizer, grad)`` moves parameter shards (FSDP1 flat parameters in place),
AdamW state and gradients; ``train_mode`` / ``eval_mode`` call it according to ``param_offload`` /
``optimizer_offload``. With FSDP2's ``offload_policy`` the parameters live on the CPU and ``to`` leaves them
there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from posttrain.core.batch import PackedBatch, temperatures
from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
from posttrain.core.determinism import enable_full_determinism
from posttrain.core.engine import BaseEngine, PerTensorParams
from posttrain.core.memory_policy import resolve_gradient_checkpointing
from posttrain.core.module_engine import ModuleEngineMixin, ensure_process_group
from posttrain.core.optimizer import OptimizerMixin, build_adamw, move_grads, move_optimizer_state
from posttrain.core.token_stats import HeadRequest, shifted_targets, token_outputs

from . import layout as layouts
from . import sharding
from .config import FSDPEngineConfig
from .inputs import ModelInputs, packed_inputs, padded_inputs
from .logprobs import PackedLogProbHead
from .modeling import (
    build_model,
    compile_decoder_layers,
    has_safetensors,
    init_rope_buffers,
    load_weights,
    materialize,
)
from .weights import (
    iter_rollout_tensors,
    lora_scalings,
    peft_config_dict,
    tied_duplicates,
)


class FSDPEngine(ModuleEngineMixin, OptimizerMixin, BaseEngine):
    """Shared machinery; subclasses set :attr:`value_model` and what the forward returns. The micro-batch loop
    and the optimizer calls are engine-core's (:class:`ModuleEngineMixin`, :class:`OptimizerMixin`)."""

    value_model = False

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: FSDPEngineConfig,
        optimizer_config: OptimizerConfig,
        checkpoint_config: CheckpointConfig,
    ) -> None:
        if not isinstance(engine_config, FSDPEngineConfig):
            raise ValueError(
                f"the FSDP engine needs an FSDPEngineConfig, got {type(engine_config).__name__}: "
                "set engine.strategy=fsdp2 (or fsdp)"
            )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.engine_config: FSDPEngineConfig = engine_config
        self.module: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.hf_config: Any = None
        self.device_mesh: Any = None
        self.is_lora = False
        self.peft_merge = False
        """Default of ``get_per_tensor_param(peft_merge=...)``: stream LoRA merged into the base weights."""
        self.layout: layouts.PlainLayout = layouts.PlainLayout(engine_config, torch.device("cpu"))
        """How the module is laid out (:mod:`.layout`): chosen in :meth:`initialize`."""
        self.peft_config: Any = None
        self._peft_model: Any = None
        self._hf_model: torch.nn.Module | None = None
        self._tied_names: set[str] = set()
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ construction
    def initialize(self) -> None:
        cfg = self.engine_config
        if cfg.full_determinism:
            enable_full_determinism(cfg.seed)
        distributed = ensure_process_group()
        if torch.cuda.is_available():
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self._device)
        layout_cls = getattr(layouts, cfg.sharded_layout()) if distributed else layouts.PlainLayout
        self.layout = layout = layout_cls(cfg, self._device)
        fsdp_size = getattr(cfg, "fsdp_size", -1)
        shards = fsdp_size if fsdp_size > 0 else (torch.distributed.get_world_size() if distributed else 1)
        self.model_config = resolve_gradient_checkpointing(self.model_config, cfg, self._device, shards)
        built = build_model(
            self.model_config,
            cfg,
            value_model=self.value_model,
            init_device=layout.init_device(),
            meta=layout.meta,
        )
        self.hf_config, self._hf_model, self.peft_config = built.hf_config, built.hf_model, built.peft_config
        self.is_lora = built.peft_config is not None
        self._tied_names = tied_duplicates(built.hf_model)
        self._peft_model = built.module if self.is_lora else None
        module = built.module
        load_kwargs = {
            "adapter_dir": self.model_config.lora_adapter_path,
            "seed": cfg.seed,
            "init_std": getattr(self.hf_config, "initializer_range", 0.02),
        }
        if not built.on_meta and has_safetensors(self.model_config.path):
            load_weights(module, self.model_config.path, **load_kwargs)
        if cfg.compile_layers and self._device.type == "cuda":
            compile_decoder_layers(built.hf_model, sharding.decoder_layer_classes(built.hf_model))
        module = layout.wrap(module, built.hf_model, self.is_lora)
        self.device_mesh = layout.mesh
        if built.on_meta:
            materialize(module, "cpu" if layout.materialize_on_cpu else self._device)
            load_weights(module, self.model_config.path, **load_kwargs)
            init_rope_buffers(built.hf_model)
        self.module = module
        if not cfg.forward_only:
            fused = self._device.type == "cuda" and not layout.materialize_on_cpu
            self.optimizer, self.lr_scheduler = build_adamw(module, self.optimizer_config, fused)
        self.apply_offload_config()

    # ------------------------------------------------------------------ properties and layout
    def get_data_parallel_size(self) -> int:
        return self.layout.dp_size()

    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_rank()

    def get_data_parallel_group(self) -> Any:
        return self.layout.dp_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def disable_adapter(self) -> contextlib.AbstractContextManager[Any]:
        return self._peft_model.disable_adapter() if self.is_lora else contextlib.nullcontext()

    def _reshard(self) -> None:
        """Free parameters FSDP2 still holds gathered (the root's after forward, and every layer's when
        ``reshard_after_forward`` is off) once no backward follows."""
        self.layout.reshard(self.module)

    # ------------------------------------------------------------------ device moves
    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        device = torch.device(device)
        params = list(self.module.parameters())
        keep_on_cpu = self.layout.keeps_params_on_cpu()
        if model and not keep_on_cpu:
            self.layout.move_params(self.module, device)
        if grad and not keep_on_cpu:
            move_grads(params, device)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, "cpu" if keep_on_cpu else device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ compute
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.layout.autocast()

    def _inputs(self, mb: PackedBatch) -> ModelInputs:
        cfg = self.engine_config
        if not cfg.use_remove_padding:
            return padded_inputs(mb)
        return packed_inputs(mb, cfg.pad_to_length_bucket if cfg.pad_to_length else None)

    def clip_grad_norm(self) -> float:
        return self.layout.clip_grad_norm(self.module, self.optimizer_config.clip_grad)

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(
        self,
        *,
        base_sync_done: bool = False,
        peft_merge: bool | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> PerTensorParams:
        """Lazy (HF name, full tensor) stream in ``dtype``; by default as stored (fp32 master weights stay
        fp32: a rollout's bucket sender casts them while packing, one kernel per tensor instead of two).

        Tensors are gathered one at a time. Without LoRA: every weight, peft
        config None. With LoRA and ``peft_merge`` (default :attr:`peft_merge`): base weights with the adapter
        merged, peft config None. Otherwise the base weights when ``base_sync_done`` is False, and only the
        adapter tensors (peft names) when it is True, with the peft config dict. Every rank must consume
        it."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if self.layout.needs_params_on_device_to_stream() and self.is_param_offload_enabled:
            self.to(self._device, model=True, optimizer=False, grad=False)
        with self.layout.state_dict_context(self.module):
            state = self.module.state_dict(keep_vars=True)  # local shards, no gather
        merge = self.peft_merge if peft_merge is None else peft_merge
        scalings = lora_scalings(self.module) if self.is_lora else {}
        stream = iter_rollout_tensors(
            state,
            device=self._device,
            dtype=dtype,
            scalings=scalings,
            merge=merge or not self.is_lora,
            adapter_only=self.is_lora and base_sync_done,
            skip=self._tied_names,
        )
        if not self.is_lora or merge:
            return stream, None
        return stream, peft_config_dict(self.peft_config)

    def save_checkpoint(
        self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        """Delegates to ``posttrain.fsdp.checkpoint.save_fsdp_checkpoint``; ``max_ckpt_to_keep`` (else
        ``checkpoint.max_ckpt_to_keep``) prunes older ``global_step_<N>`` saves of this role."""
        from .checkpoint import save_fsdp_checkpoint

        save_fsdp_checkpoint(self, local_path, global_step, max_ckpt_to_keep=max_ckpt_to_keep, **kwargs)

    def prepare_checkpoint(self, role: str, writer: Any) -> None:
        """Delegates to ``posttrain.fsdp.checkpoint.prepare_fsdp_checkpoint`` (no-op without async_save)."""
        from .checkpoint import prepare_fsdp_checkpoint

        prepare_fsdp_checkpoint(self, role, writer)

    def load_checkpoint(self, local_path: str, **kwargs: Any) -> dict[str, Any]:
        """Delegates to ``posttrain.fsdp.checkpoint.load_fsdp_checkpoint``: the saved counters
        (``global_step``, ``skipped_steps``) when ``extra`` is loaded, else ``{}``."""
        from .checkpoint import load_fsdp_checkpoint

        return load_fsdp_checkpoint(self, local_path)


class FSDPLanguageModelEngine(FSDPEngine):
    """Causal LM: ``log_probs`` per token, ``entropy`` when ``batch.meta['calculate_entropy']`` and
    ``correct`` (1.0 where the token is the argmax of the logits that predict it) when
    ``batch.meta['calculate_accuracy']``."""

    value_model = False
    computes_token_accuracy = True

    def _head(self) -> PackedLogProbHead:
        return self._hf_model.lm_head

    def _forward_micro(self, mb: PackedBatch) -> dict[str, torch.Tensor]:
        inputs = self._inputs(mb)
        temp = temperatures(mb)
        filler = inputs.stream_ids.numel() - mb.num_tokens
        if filler:
            temp = torch.cat([temp, temp.new_ones(filler)])
        targets, inv_temp = shifted_targets(inputs.stream_ids, temp)
        with_entropy = bool(mb.meta.get("calculate_entropy", False))
        with_accuracy = bool(mb.meta.get("calculate_accuracy", False))
        head = self._head()
        head.request = HeadRequest(
            targets,
            inv_temp,
            with_entropy,
            self.engine_config.logits_chunk_size(targets.numel()),
            inputs.valid_index,
            checkpoint=self.engine_config.entropy_checkpointing,
            with_accuracy=with_accuracy,
        )
        try:
            with self._autocast():
                stats = self.module(**inputs.kwargs, use_cache=False).logits
        finally:
            head.request = None
        stats = stats[: mb.num_tokens].float()
        return token_outputs(stats, mb.cu_seqlens, with_entropy, with_accuracy)


class FSDPValueModelEngine(FSDPEngine):
    """Value model (HF token classification, one label): ``values[t]`` is the head's output at token t."""

    value_model = True

    def _forward_micro(self, mb: PackedBatch) -> dict[str, torch.Tensor]:
        inputs = self._inputs(mb)
        with self._autocast():
            logits = self.module(**inputs.kwargs, use_cache=False).logits
        flat = logits.reshape(-1).float()
        if inputs.valid_index is not None:
            flat = flat.index_select(0, inputs.valid_index)
        return {"values": flat[: mb.num_tokens]}
