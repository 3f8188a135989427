"""The deprecated standalone ``mbridge`` package (``engine.vanilla_mbridge=true``) behind the bridge calls the
engine makes.

``VanillaBridge`` builds the model chunks with ``mbridge.AutoBridge.from_pretrained(dir).get_model(...)`` and
offers the Megatron-Bridge methods the engine and its checkpoints call (``load_hf_weights``,
``get_conversion_tasks``, ``export_hf_weights``, ``save_hf_weights``) over mbridge's ``load_weights``,
``export_weights`` and ``save_weights``. mbridge builds its own TransformerConfig from the HF config;
posttrain passes the settings it also sets on Megatron-Bridge's provider (dropout off, ``sequence_parallel``,
fusions off without CUDA, the user's ``override_transformer_config``) through ``set_extra_args``.

Written against mbridge 0.15.1 (the extra ``posttrain-engine-megatron[mbridge]``), with three adaptations:

- mbridge always asks for Transformer Engine's layer spec. Without Transformer Engine the bridge builds the
  engine's local layers instead (:func:`posttrain.megatron.attention.layer_spec`, the same spec as the
  Megatron-Bridge path) and maps their separate norms (``input_layernorm``, ``pre_mlp_layernorm``) to HF's
  ``input_layernorm`` and ``post_attention_layernorm``; mbridge's own mapping knows only Transformer Engine's
  fused ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``.
- transformers 5 keeps ``rope_theta`` in ``config.rope_parameters``; mbridge reads ``config.rope_theta``, so
  the bridge copies it there (only for ``rope_type='default'``: mbridge applies no RoPE scaling).
- Megatron-FSDP, router replay and LoRA are not offered (:func:`check`, ``rules.py``), and the
  ``posttrain convert`` commands stay on Megatron-Bridge.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from posttrain.core.dtypes import parse_dtype

from . import _deps, build
from .config import McoreEngineConfig

DEPRECATION = (
    "engine.vanilla_mbridge=true builds the model through the deprecated standalone `mbridge` package; "
    "set engine.vanilla_mbridge=false to use NVIDIA Megatron-Bridge (the maintained successor)"
)
"""The DeprecationWarning every vanilla build emits."""

LOCAL_NORMS = {
    "_OTHER_MAPPING": {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]},
    "_MLP_MAPPING": {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]
    },
}
"""mbridge name-mapping tables -> the entries the local layer spec adds (Megatron suffix -> HF names)."""


def check(cfg: McoreEngineConfig) -> None:
    """Warn that the path is deprecated, import ``mbridge`` (ImportError with the install hint) and reject
    what it cannot do."""
    warnings.warn(DEPRECATION, DeprecationWarning, stacklevel=3)
    _deps.import_vanilla_mbridge()
    if cfg.use_megatron_fsdp:
        raise ValueError(
            "engine.vanilla_mbridge=true with engine.use_megatron_fsdp=true: the mbridge path wraps models "
            "in Megatron DDP only; set engine.use_megatron_fsdp=false or engine.vanilla_mbridge=false"
        )
    if cfg.router_replay.mode != "disabled":
        raise ValueError(
            f"engine.vanilla_mbridge=true with engine.router_replay.mode={cfg.router_replay.mode}: router "
            "replay is wired through Megatron-Bridge's provider only; set engine.vanilla_mbridge=false"
        )


def extra_args(
    cfg: McoreEngineConfig, *, on_cuda: bool, use_te: bool, recompute: bool = False
) -> dict[str, Any]:
    """TransformerConfig fields posttrain sets on top of mbridge's own (``recompute``:
    ``build.FULL_RECOMPUTE``; the user's overrides last)."""
    extra: dict[str, Any] = {
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "moe_router_load_balancing_type": "none",
        "sequence_parallel": cfg.sequence_parallel,  # mbridge's default is tp_size > 1
        "fp16": cfg.dtype == "float16",
        "use_cpu_initialization": not on_cuda,
    }
    if not (on_cuda and use_te):
        extra.update({name: False for name in build.CPU_OFF_FUSIONS})
    if recompute:
        extra.update(build.FULL_RECOMPUTE)
    extra.update(cfg.override_transformer_config)
    return extra


def _copy_rope_theta(hf_config: Any) -> None:
    """Give a transformers-5 config the ``rope_theta`` attribute mbridge 0.15.1 reads."""
    if getattr(hf_config, "rope_theta", None) is not None:
        return
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        raise ValueError(
            f"engine.vanilla_mbridge=true with rope_parameters={rope}: mbridge applies plain RoPE only "
            "(rope_type='default' with a rope_theta); set engine.vanilla_mbridge=false"
        )
    hf_config.rope_theta = rope["rope_theta"]


def _use_local_layers(bridge: Any) -> None:
    """Build the engine's local (non-Transformer-Engine) layers and map their separate norms."""
    from .attention import layer_spec

    bridge._get_transformer_layer_spec = lambda vp_stage=None: layer_spec(bridge.config, False, vp_stage)
    bridge.has_vp_stage = True  # read by mbridge's provider; set by the spec method this replaces
    for table, entries in LOCAL_NORMS.items():
        setattr(bridge, table, {**getattr(bridge, table), **entries})  # instance copies: classes stay as is


def instantiate(provide: Callable[..., Any], vpp: int | None) -> list[torch.nn.Module]:
    """mbridge's model provider called for this rank's pipeline (and virtual pipeline) stages.

    mbridge 0.15.1's own ``get_model`` reads ``ModelType.encoder_and_decoder``, which Megatron-Core 0.19 no
    longer has; this and :func:`wrap` do what it did, as Megatron-Bridge's ``get_model`` does."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )

    pp = mpu.get_pipeline_model_parallel_group()
    chunks = []
    for vp_stage in range(vpp or 1):
        chunk = provide(
            pre_process=is_vp_first_stage(vp_stage, vpp) and is_pp_first_stage(pp),
            post_process=is_vp_last_stage(vp_stage, vpp) and is_pp_last_stage(pp),
            vp_stage=vp_stage if vpp else None,
        )
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunks.append(chunk)
    return chunks


def wrap(
    chunks: list[torch.nn.Module], config: Any, cfg: McoreEngineConfig, *, wrap_with_ddp: bool, on_cuda: bool
) -> list[torch.nn.Module]:
    """Move to the GPU, wrap in Float16Module (bf16/fp16) and, to train, in Megatron DDP."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    if on_cuda:
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    if config.fp16 or config.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if not wrap_with_ddp:
        return chunks
    ddp = build.make_ddp_config(cfg)
    return [
        DistributedDataParallel(config=config, ddp_config=ddp, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


class VanillaBridge:
    """An ``mbridge`` Bridge for one HF directory, with the Megatron-Bridge method names the engine calls."""

    def __init__(
        self,
        model_path: str,
        cfg: McoreEngineConfig,
        *,
        on_cuda: bool,
        trust_remote_code: bool,
        recompute: bool,
    ):
        mbridge = _deps.import_vanilla_mbridge()
        self.model_path = model_path
        self.cfg = cfg
        self.bridge = mbridge.AutoBridge.from_pretrained(
            model_path, trust_remote_code=trust_remote_code, dtype=parse_dtype(cfg.dtype)
        )
        _copy_rope_theta(self.bridge.hf_config)
        use_te = _deps.has_transformer_engine()
        self.bridge.set_extra_args(**extra_args(cfg, on_cuda=on_cuda, use_te=use_te, recompute=recompute))
        if not use_te:
            _use_local_layers(self.bridge)

    def build_model(self, *, wrap_with_ddp: bool, on_cuda: bool, value_head: Any = None) -> list:
        """This rank's model chunks (one per virtual pipeline stage), wrapped in Megatron DDP when
        training."""
        chunks = instantiate(self.bridge._model_provider([]), self.cfg.virtual_pipeline_model_parallel_size)
        if value_head is not None:
            chunks = value_head(chunks)
        return wrap(chunks, self.bridge.config, self.cfg, wrap_with_ddp=wrap_with_ddp, on_cuda=on_cuda)

    def load_hf_weights(self, chunks: list, allowed_mismatched_params: Any = None) -> None:
        """HF safetensors into the chunks (mbridge skips the LM head of a value model by itself)."""
        self.bridge.load_weights(chunks, self.model_path)

    def get_conversion_tasks(self, chunks: list) -> None:
        """mbridge has no reusable conversion plan."""
        return None

    def export_hf_weights(self, chunks: list, cpu: bool = False, show_progress: bool = False, **_: Any):
        """``(hf_name, full tensor)`` pairs, detached, like Megatron-Bridge's ``export_hf_weights`` (mbridge
        yields views of the parameters that still carry autograd history)."""
        for name, tensor in self.bridge.export_weights(chunks):
            yield name, tensor.detach().cpu() if cpu else tensor.detach()

    def save_hf_weights(
        self, chunks: list, path: str | Path, show_progress: bool = False, memory_efficient: bool = False
    ) -> None:
        """Safetensors of the full model into ``path`` (rank 0 writes)."""
        self.bridge.save_weights(chunks, str(path), memory_efficient=memory_efficient)
