"""Checks of a megatron engine config against the model, the checkpoint config and the machine.

The per-field rules live in ``McoreEngineConfig.__post_init__`` (:mod:`.config`); the ones here need more than
one config, or the HF model config, or to know whether CUDA is there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.core.config import CheckpointConfig, ModelConfig

from . import lora, vanilla
from .config import McoreEngineConfig


def _hf_config(model: ModelConfig) -> dict:
    path = Path(model.path) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model.path={model.path!r} has no config.json: point model.path at a local Hugging Face "
            "model directory"
        )
    return json.loads(path.read_text())


def _num_experts(hf: dict) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def check_layout(cfg: McoreEngineConfig, hf: dict) -> None:
    """Rules between the parallel layout and the model's shape."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(
            f"engine.virtual_pipeline_model_parallel_size={vpp} needs "
            "pipeline_model_parallel_size > 1: set it to null or raise the PP size"
        )
    layers = int(hf.get("num_hidden_layers", 0))
    stages = pp * (vpp or 1)
    if layers and layers % stages:
        raise ValueError(
            f"the model has {layers} layers, which pipeline_model_parallel_size x "
            f"virtual_pipeline_model_parallel_size = {stages} does not divide: choose sizes whose "
            f"product divides {layers}"
        )
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = hf.get(key)
        if heads and int(heads) % tp:
            raise ValueError(
                f"{key}={heads} is not divisible by tensor_model_parallel_size={tp}: pick a TP size "
                f"that divides {heads}"
            )
    experts = _num_experts(hf)
    if cfg.expert_model_parallel_size > 1 and not experts:
        raise ValueError(
            f"engine.expert_model_parallel_size={cfg.expert_model_parallel_size} on a dense model "
            "(no experts in config.json): set it to 1"
        )
    if experts and experts % cfg.expert_model_parallel_size:
        raise ValueError(
            f"{experts} experts are not divisible by expert_model_parallel_size="
            f"{cfg.expert_model_parallel_size}: pick an EP size that divides {experts}"
        )
    if cfg.router_replay.mode != "disabled" and not experts:
        raise ValueError(
            f"engine.router_replay.mode={cfg.router_replay.mode} on a dense model: router replay "
            "needs an MoE model; set engine.router_replay.mode=disabled"
        )
    if cfg.router_replay.mode != "disabled" and pp > 1:
        raise ValueError(
            f"engine.router_replay.mode={cfg.router_replay.mode} with pipeline_model_parallel_size="
            f"{pp} is not implemented: use PP=1 (TP/EP are fine)"
        )


def check_context_parallel(cfg: McoreEngineConfig) -> None:
    """What context parallelism (CP > 1) is not combined with."""
    cp = cfg.context_parallel_size
    if cfg.use_megatron_fsdp:
        raise ValueError(
            f"engine.context_parallel_size={cp} with engine.use_megatron_fsdp=true is untested "
            "(Megatron-FSDP would shard over data x context parallel ranks): set context_parallel_size=1 or "
            "use_megatron_fsdp=false"
        )
    if cfg.router_replay.mode != "disabled":
        raise ValueError(
            f"engine.context_parallel_size={cp} with engine.router_replay.mode={cfg.router_replay.mode} is "
            "not implemented (the recorded experts are in packed token order, not per CP chunk): set "
            "context_parallel_size=1 or router_replay.mode=disabled"
        )


def check_engine(
    cfg: McoreEngineConfig, ckpt: CheckpointConfig, model: ModelConfig, *, on_cuda: bool, role: str = "actor"
) -> None:
    """Every cross-config rule, raising a ValueError that names the bad value and the fix."""
    cfg.check_checkpoint(ckpt, role)
    if cfg.vanilla_mbridge:
        vanilla.check(cfg)
    if cfg.use_megatron_fsdp and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError(
            "engine.use_megatron_fsdp=true with CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron-FSDP needs the "
            "variable unset or > 1 (Megatron-LM and Megatron-Bridge refuse 1 for FSDP; it is TP/SP overlap "
            "that wants 1): unset CUDA_DEVICE_MAX_CONNECTIONS or set it to 8 (examples/grpo_megatron.sh does "
            "with MEGATRON_FSDP=1)"
        )
    if cfg.use_megatron_fsdp and not on_cuda:
        raise ValueError(
            "engine.use_megatron_fsdp=true needs CUDA (Megatron-FSDP allocates CUDA streams): "
            "run on GPUs or set engine.use_megatron_fsdp=false"
        )
    if cfg.use_megatron_fsdp and cfg.pipeline_model_parallel_size > 1:
        raise ValueError(
            "engine.use_megatron_fsdp=true with pipeline_model_parallel_size > 1 is not supported "
            "by Megatron-FSDP: set pipeline_model_parallel_size=1"
        )
    if cfg.context_parallel_size > 1:
        check_context_parallel(cfg)
    if cfg.use_dist_checkpointing and not cfg.dist_checkpointing_path:
        raise ValueError(
            "engine.use_dist_checkpointing=true needs engine.dist_checkpointing_path (a dist_ckpt "
            "directory written by `posttrain convert hf-to-megatron` or a save)"
        )
    if cfg.use_remove_padding is False:
        raise ValueError(
            "engine.use_remove_padding=false is not implemented by the megatron engine (it always "
            "runs packed THD micro-batches): set engine.use_remove_padding=true"
        )
    if model.override_config:
        raise ValueError(
            f"model.override_config={dict(model.override_config)} is not applied by the megatron engine "
            "(Megatron-Bridge builds from config.json): set Megatron's fields through "
            "engine.override_transformer_config (e.g. num_layers, share_embeddings_and_output_weights) "
            "or edit config.json"
        )
    if model.lora_rank > 0:
        _check_lora(cfg, model)
    check_layout(cfg, _hf_config(model))


def _check_lora(cfg: McoreEngineConfig, model: ModelConfig) -> None:
    lora.check_config(model)
    if cfg.vanilla_mbridge:
        raise ValueError(
            f"model.lora_rank={model.lora_rank} with engine.vanilla_mbridge=true: LoRA goes through "
            "Megatron-Bridge's PEFT; set engine.vanilla_mbridge=false"
        )
    if cfg.use_megatron_fsdp:
        raise ValueError(
            f"model.lora_rank={model.lora_rank} with engine.use_megatron_fsdp=true is untested with "
            "Megatron-Bridge's LoRA: set engine.use_megatron_fsdp=false"
        )
    if cfg.portable_checkpoint:
        raise NotImplementedError(
            f"engine.portable_checkpoint=true with model.lora_rank={model.lora_rank}: the HF-keyed portable "
            "layout has no names for the Megatron LoRA adapters; set engine.portable_checkpoint=false (the "
            "native dist_ckpt saves the adapters)"
        )
