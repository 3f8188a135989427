"""The torchtitan engine: torchtitan's Qwen3 / Llama-3 model for an HF checkpoint behind posttrain's
BaseEngine.

Layout. Under ``torchrun`` (``WORLD_SIZE`` set) the engine initialises the default process group if the caller
has not (NCCL on CUDA, gloo on CPU), splits the model over groups of ``tp_size`` consecutive ranks with
torchtitan's tensor parallelism, and shards with torchtitan's FSDP2 function over the data-parallel ranks
(world / tp_size), or HSDP when ``0 < fsdp_size <`` that. The ranks of one TP group take the same data; TP
rank 0 returns the outputs. In a plain process it runs the unsharded model (autocast to ``dtype`` when that
differs from ``model_dtype``).

A step. ``forward_backward_batch`` splits the packed batch into micro-batches (by token budget with
``use_dynamic_bsz``, else by count), runs every rank through the same number of them (zero-weighted 2-token
filler passes on a rank with fewer), and hands each micro-batch's outputs to the loss function with the step's
global token counts (:func:`posttrain.core.loss_context`). The model sees one packed row with positions that
restart per document and torchtitan's varlen metadata (:mod:`posttrain.torchtitan.attention`); its output
layer returns next-token log-probs (and entropy on request) chunk by chunk (:mod:`posttrain.torchtitan.head`).
``optimizer_step`` clips to ``clip_grad`` and skips the update on a non-finite norm; the LR follows
``OptimizerConfig.lr_multiplier`` through ``LambdaLR``.

Names. Weights load from the HF safetensors, stream to the rollout and go into checkpoints through the
HF-named view of the model (:func:`posttrain.torchtitan.modeling.hf_view`), so checkpoints have the FSDP
engine's layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.core.batch import PackedBatch, temperatures
from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
from posttrain.core.determinism import enable_full_determinism
from posttrain.core.engine import BaseEngine, PerTensorParams
from posttrain.core.memory_policy import resolve_gradient_checkpointing
from posttrain.core.module_engine import ModuleEngineMixin, ensure_process_group
from posttrain.core.optimizer import (
    OptimizerMixin,
    build_adamw,
    grad_norm_and_clip,
    move_grads,
    move_optimizer_state,
)
from posttrain.core.token_stats import HeadRequest, shifted_targets, token_outputs

from . import compat, modeling, moe, parallel
from .attention import inner_attention_config, packed_metadata
from .config import TorchTitanEngineConfig

logger = logging.getLogger(__name__)


class HFConfig(SimpleNamespace):
    """An HF ``config.json`` as attributes; ``save_pretrained`` writes it back (what checkpoints call)."""

    def save_pretrained(self, out_dir: str) -> None:
        Path(out_dir, "config.json").write_text(json.dumps(vars(self), indent=2, sort_keys=True) + "\n")


def read_hf_config(model_config: ModelConfig) -> HFConfig:
    """``config.json`` of ``model.path`` with ``model.override_config`` applied."""
    model_config.require_weights()
    path = Path(model_config.path) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.path={model_config.path!r} has no config.json: point it at an HF model dir")
    return HFConfig(**(json.loads(path.read_text()) | dict(model_config.override_config)))


def check_model_config(model_config: ModelConfig, engine_config: TorchTitanEngineConfig) -> None:
    """Refuse what this engine cannot do with the model, before any work."""
    if model_config.lora_rank > 0:
        raise ValueError(
            f"model.lora_rank={model_config.lora_rank}: the torchtitan engine has no LoRA (torchtitan "
            "0.3.0's models have no adapters); set model.lora_rank=0, or use model_engine=fsdp2 for LoRA"
        )
    hf_config = read_hf_config(model_config)
    modeling.check_supported(hf_config)
    modeling.check_tensor_parallel(hf_config, engine_config.tp_size)
    moe.check_expert_parallel(hf_config, engine_config.ep_size)


def read_hf_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory's safetensors files, by HF name."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights: the torchtitan engine loads safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


class TorchTitanLanguageModelEngine(ModuleEngineMixin, OptimizerMixin, BaseEngine):
    """Causal LM: ``log_probs`` per token, ``entropy`` when ``batch.meta['calculate_entropy']`` and
    ``correct`` (1.0 where the token is the argmax of the logits that predict it) when
    ``batch.meta['calculate_accuracy']``.
    The micro-batch loop and the optimizer calls are engine-core's (:class:`ModuleEngineMixin`,
    :class:`OptimizerMixin`), as the FSDP engine's."""

    computes_token_accuracy = True
    value_model = False
    """A value model (:class:`TorchTitanValueModelEngine`) has a ``hidden -> 1`` head instead of the LM
    head."""

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: TorchTitanEngineConfig,
        optimizer_config: OptimizerConfig,
        checkpoint_config: CheckpointConfig,
    ) -> None:
        if not isinstance(engine_config, TorchTitanEngineConfig):
            raise ValueError(
                f"the torchtitan engine needs a TorchTitanEngineConfig, got {type(engine_config).__name__}: "
                "set model_engine=torchtitan"
            )
        check_model_config(model_config, engine_config)
        if self.value_model and engine_config.tp_size > 1:
            raise ValueError(
                f"engine.tp_size={engine_config.tp_size} for the critic: the torchtitan value model runs "
                "without tensor parallelism; set critic.engine.tp_size=1"
            )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.is_moe = moe.is_moe(read_hf_config(model_config))
        """A Qwen3-MoE model (:mod:`posttrain.torchtitan.moe`)."""
        if self.is_moe:
            from .checkpoint import check_moe_contents

            check_moe_contents(list(checkpoint_config.save_contents))
        self.engine_config: TorchTitanEngineConfig = engine_config
        self.module: torch.nn.Module | None = None
        self.hf_module: torch.nn.Module | None = None
        """The HF-named view of :attr:`module` (same parameters)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.hf_config: Any = None
        self.device_mesh: Any = None
        """The data-parallel mesh FSDP2 shards over (None in one process)."""
        self.parallel_dims: Any = None
        """torchtitan's ``ParallelDims`` with its meshes (None in one process)."""
        self.distributed = False
        self._tied: set[str] = set()
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ construction
    def initialize(self) -> None:
        cfg = self.engine_config
        if cfg.full_determinism:
            enable_full_determinism(cfg.seed)
        self.distributed = ensure_process_group()
        if torch.cuda.is_available():
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self._device)
        for key, size in (("tp_size", cfg.tp_size), ("ep_size", cfg.ep_size)):
            if not self.distributed and size > 1:
                raise ValueError(
                    f"engine.{key}={size} in a single process: launch {size} or more ranks with torchrun, or "
                    f"set engine.{key}=1"
                )
        compat.check_moe_sharding(self.is_moe, self.distributed)
        world = torch.distributed.get_world_size() if self.distributed else 1
        self.model_config = resolve_gradient_checkpointing(self.model_config, cfg, self._device, world)
        self.hf_config = read_hf_config(self.model_config)
        if self.distributed:
            self.parallel_dims = parallel.build_parallel_dims(self._device.type, cfg)
            self.device_mesh = parallel.dp_mesh(self.parallel_dims)
        compute = getattr(torch, cfg.dtype)
        model = modeling.build_model(
            self.hf_config,
            inner_attention_config(self._device, compute),
            cfg.tp_size,
            self.value_model,
            moe.experts_config(self._device, compute, cfg.ep_size) if self.is_moe else None,
        )
        self.hf_module = modeling.hf_view(model, self.hf_config.model_type)
        self._tied = {"lm_head.weight"} if model.enable_weight_tying else set()
        if not self.value_model:
            model.lm_head.use_compile = cfg.use_torch_compile
        if self.distributed:
            parallel.apply_tensor_parallel(model, self.parallel_dims)
        parallel.apply_activation_checkpointing(
            model, cfg.ac_mode(self.model_config.enable_gradient_checkpointing)
        )
        if cfg.compile:
            parallel.apply_compile(model, self.parallel_dims)
        if self.distributed:
            parallel.apply_fsdp(model, self.parallel_dims, cfg)
        modeling.materialize(model, self._device, cfg.seed)
        self.module = model
        self._load_hf_weights()
        if not cfg.forward_only:
            self.optimizer, self.lr_scheduler = build_adamw(
                model, self.optimizer_config, self._device.type == "cuda"
            )
        self.apply_offload_config()

    def _load_hf_weights(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        weights = moe.group_experts(read_hf_weights(self.model_config.path))
        expected = set(self.hf_module.state_dict())
        missing = expected - set(weights) - self._tied
        head = {k for k in missing if k.startswith(f"{modeling.VALUE_HEAD}.")} if self.value_model else set()
        if head:
            logger.info("torchtitan value model: %s not in %s, initialised (seed %d)", sorted(head),
                        self.model_config.path, self.engine_config.seed)  # fmt: skip
            missing -= head
        if missing:
            raise ValueError(
                f"{self.model_config.path} lacks {sorted(missing)[:4]} ({len(missing)} tensors) that the "
                f"{self.hf_config.model_type} model needs: is it a complete HF checkpoint of this config?"
            )
        weights = {k: v for k, v in weights.items() if k in expected}
        set_model_state_dict(
            self.hf_module, weights, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    # ------------------------------------------------------------------ properties and layout
    def get_data_parallel_size(self) -> int:
        return self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard if self.distributed else 1

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank() // self.engine_config.tp_size if self.distributed else 0

    def get_data_parallel_group(self) -> Any:
        if not self.distributed or self.get_data_parallel_size() == 1:
            return None
        if self.parallel_dims.tp_enabled:
            return self.parallel_dims.get_mesh("batch").get_group()
        return dist.group.WORLD

    def is_mp_src_rank_with_outputs(self) -> bool:
        """TP rank 0 of each tensor-parallel group (every rank without TP)."""
        return not self.distributed or dist.get_rank() % self.engine_config.tp_size == 0

    def _reshard(self) -> None:
        """Free parameters FSDP2 still holds gathered once no backward follows."""
        if self.distributed:
            from torch.distributed.fsdp import FSDPModule

            for sub in self.module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        device = torch.device(device)
        if model:
            self.module.to(device)
        if grad:
            move_grads(list(self.module.parameters()), device)
        if optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ compute
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        compute = getattr(torch, self.engine_config.dtype)
        master = getattr(torch, self.engine_config.model_dtype)
        if self.distributed or compute == master:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=compute)

    def _forward_micro(self, mb: PackedBatch) -> dict[str, torch.Tensor]:
        """Per-token outputs of one micro-batch (on the device; its boundaries read from
        ``host_cu_seqlens``)."""
        ids = mb.input_ids
        targets, inv_temp = shifted_targets(ids, temperatures(mb))
        with_entropy = bool(mb.meta.get("calculate_entropy", False))
        with_accuracy = bool(mb.meta.get("calculate_accuracy", False))
        head = self.module.lm_head
        head.request = HeadRequest(
            targets,
            inv_temp,
            with_entropy,
            self.engine_config.logits_chunk_size(targets.numel()),
            with_accuracy=with_accuracy,
            checkpoint=self.engine_config.entropy_checkpointing,
        )
        try:
            with self._autocast():
                stats = self.module(ids[None], mb.position_ids[None], self._packed_metadata(mb))
        finally:
            head.request = None
        if isinstance(stats, DTensor):  # the TP output layer's statistics, whole on every rank
            stats = stats.to_local()
        return token_outputs(stats.float(), mb.cu_seqlens, with_entropy, with_accuracy)

    def _packed_metadata(self, mb: PackedBatch) -> Any:
        """torchtitan's varlen metadata of ``mb``'s documents, from the host copy of its boundaries."""
        return packed_metadata(mb.host_cu_seqlens, self._device)

    def clip_grad_norm(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.parallel_dims is not None and self.parallel_dims.tp_enabled:
            return parallel.dtensor_grad_norm_and_clip(params, self.optimizer_config.clip_grad)
        group = self.device_mesh.get_group("fsdp") if self.device_mesh is not None else None
        return grad_norm_and_clip(params, self.optimizer_config.clip_grad, group, self._device)

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(
        self,
        *,
        base_sync_done: bool = False,
        peft_merge: bool | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> PerTensorParams:
        """Lazy (HF name, full tensor) stream in ``dtype`` (default: as stored), MoE experts one tensor per
        expert; a tied ``lm_head`` is left out as ``save_pretrained`` does. Every rank must consume it (each
        gather is a collective). There is no LoRA here: ``base_sync_done`` and ``peft_merge`` change nothing,
        and the peft config is None."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        state = self.hf_module.state_dict(keep_vars=True)

        def stream():
            for name, tensor in state.items():
                if name in self._tied:
                    continue
                full = parallel.full_tensor(tensor, self._device)
                for hf_name, part in moe.split_experts(name, full):  # per expert, as HF and vLLM name them
                    yield hf_name, part if dtype is None else part.to(dtype)

        return stream(), None

    def save_checkpoint(
        self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        """Delegates to ``posttrain.torchtitan.checkpoint.save_checkpoint``."""
        from .checkpoint import save_checkpoint

        save_checkpoint(self, local_path, global_step, max_ckpt_to_keep=max_ckpt_to_keep, **kwargs)

    def prepare_checkpoint(self, role: str, writer: Any) -> None:
        """Delegates to ``posttrain.torchtitan.checkpoint.prepare_checkpoint`` (no-op without async_save)."""
        from .checkpoint import prepare_checkpoint

        prepare_checkpoint(self, role, writer)

    def load_checkpoint(self, local_path: str, **kwargs: Any) -> dict[str, Any]:
        """Delegates to ``posttrain.torchtitan.checkpoint.load_checkpoint``: the saved counters."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, local_path)


class TorchTitanValueModelEngine(TorchTitanLanguageModelEngine):
    """Value model (PPO critic): ``values[t]`` is the ``score`` head's output at token t, as HF's
    ``*ForTokenClassification`` with one label gives it. The head loads from ``score.*`` in the checkpoint, or
    starts from the seeded init (normal weight, zero bias) when a causal LM has none."""

    computes_token_accuracy = False
    value_model = True

    def _forward_micro(self, mb: PackedBatch) -> dict[str, torch.Tensor]:
        with self._autocast():
            out = self.module(mb.input_ids[None], mb.position_ids[None], self._packed_metadata(mb))
        return {"values": out.reshape(-1).float()}
