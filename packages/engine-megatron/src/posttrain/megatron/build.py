"""Build a Megatron-Core model, its optimizer and its parallel layout from a local Hugging Face directory.

The path is Megatron-Bridge's: ``AutoBridge.from_hf_pretrained(dir)`` reads the HF config,
``to_megatron_provider`` turns it into a GPT model provider, posttrain sets the parallel sizes, dtype, layer
spec and the user's ``override_transformer_config`` on that provider, ``provide_distributed_model``
instantiates the VPP chunks (wrapped in Megatron DDP or Megatron-FSDP when training) and ``load_hf_weights``
copies the HF weights in, slicing them for this rank's TP/PP/EP shard.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from posttrain.core.config import OptimizerConfig
from posttrain.core.dtypes import parse_dtype

from . import _deps
from .attention import layer_spec
from .config import McoreEngineConfig

FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
"""TransformerConfig fields for ``model.enable_gradient_checkpointing``: every decoder layer's forward runs
again in backward, as HF's per-layer gradient checkpointing does (``override_transformer_config`` may set
others)."""

CPU_OFF_FUSIONS = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_grouped_gemm",
)
"""Fused kernels that need CUDA extensions (apex/TE); turned off when they cannot run (MoE experts then run
as Megatron's SequentialMLP)."""


CUDA_TE_FUSIONS = {"apply_rope_fusion": True, "bias_activation_fusion": True, "bias_dropout_fusion": True}
"""Fusions Megatron-LM's training turns on by default (its ``--no-rope-fusion``, ``--no-bias-swiglu-fusion``,
``--no-bias-dropout-fusion`` flags) that TransformerConfig and Megatron-Bridge's GPT provider leave off: TE's
fused RoPE for packed (THD) sequences, one kernel with no host sync where Megatron-Core's unfused THD RoPE
reads the sequence lengths back per layer; the fused SwiGLU; the fused bias-dropout-add. Set on CUDA with TE
only; ``override_transformer_config`` may turn each off."""


def parallel_sizes(cfg: McoreEngineConfig) -> dict[str, Any]:
    """The TP / PP / VPP / CP / EP / ETP sizes of ``cfg`` under Megatron's argument names."""
    return dict(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )


def init_model_parallel(cfg: McoreEngineConfig, seed: int) -> None:
    """Create Megatron's process groups for ``cfg``'s layout once per process (roles share one layout)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if not torch.distributed.is_initialized():
        raise ValueError(
            "the megatron engine needs torch.distributed initialised (run under torchrun, or call "
            "torch.distributed.init_process_group first)"
        )
    cfg.check_world_size(torch.distributed.get_world_size())
    layout = parallel_sizes(cfg)
    if mpu.model_parallel_is_initialized():
        current = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
            mpu.get_expert_model_parallel_world_size(),
        )
        wanted = (
            cfg.tensor_model_parallel_size,
            cfg.pipeline_model_parallel_size,
            cfg.context_parallel_size,
            cfg.expert_model_parallel_size,
        )
        if current != wanted:
            raise ValueError(
                f"Megatron parallel state is already initialised as (TP, PP, CP, EP)={current} but "
                f"this engine asks for {wanted}: all megatron roles of one process share a layout"
            )
        return
    mpu.initialize_model_parallel(**layout)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def make_bridge(model_path: str, trust_remote_code: bool = False, config_only: bool = False) -> Any:
    """Megatron-Bridge's AutoBridge for a local HF directory (no downloads); ``config_only`` when the
    directory has a config but no weights (exporting a Megatron checkpoint)."""
    bridge_mod = _deps.import_bridge()
    if config_only:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        return bridge_mod.AutoBridge.from_hf_config(config)
    return bridge_mod.AutoBridge.from_hf_pretrained(model_path, trust_remote_code=trust_remote_code)


def _set_checked(obj: Any, overrides: dict[str, Any], key: str) -> None:
    for name, value in overrides.items():
        if not hasattr(obj, name):
            raise ValueError(
                f"engine.{key}.{name} is not a field of {type(obj).__name__}: check the spelling "
                f"against megatron-core's TransformerConfig / DistributedDataParallelConfig"
            )
        setattr(obj, name, value)


def _set_fusions(provider: Any, cfg: McoreEngineConfig, *, fused: bool) -> None:
    """:data:`CUDA_TE_FUSIONS` on where TE runs on CUDA (``fused``), :data:`CPU_OFF_FUSIONS` off elsewhere;
    ``gradient_accumulation_fusion`` off under Megatron-FSDP (its own gradient buffers) and without APEX's
    wgrad kernel, which Megatron-Core's ColumnParallelLinear (the output layer, also on the TE spec) requires
    although Megatron-Bridge turns the fusion on wherever TE imports."""
    for name, value in (CUDA_TE_FUSIONS if fused else dict.fromkeys(CPU_OFF_FUSIONS, False)).items():
        if hasattr(provider, name):
            setattr(provider, name, value)
    if cfg.use_megatron_fsdp or not _deps.has_apex_wgrad_fusion():
        provider.gradient_accumulation_fusion = False


def make_provider(
    bridge: Any,
    cfg: McoreEngineConfig,
    *,
    on_cuda: bool,
    router_replay: bool = False,
    value_model: bool = False,
    recompute: bool = False,
) -> Any:
    """The bridge's model provider with posttrain's layout, dtype, layer spec and user overrides, finalized;
    ``recompute``: :data:`FULL_RECOMPUTE`.

    A value model never ties its output layer to the embeddings (the value head replaces that layer), even
    when the HF config ties them."""
    provider = bridge.to_megatron_provider(load_weights=False)
    dtype = parse_dtype(cfg.dtype)
    use_te = _deps.has_transformer_engine()
    for name, value in dict(
        **parallel_sizes(cfg),
        sequence_parallel=cfg.sequence_parallel,
        variable_seq_lengths=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        deterministic_mode=cfg.full_determinism,
    ).items():
        setattr(provider, name, value)
    provider.transformer_layer_spec = lambda config, vp_stage=None: layer_spec(config, use_te, vp_stage)
    if (cfg.virtual_pipeline_model_parallel_size or 1) > 1:
        # Megatron-LM's (and mbridge's) p2p settings for the interleaved schedule; TransformerConfig's own
        # defaults (batched, not overlapped) hang its warm-up send_forward_recv_forward on variable-length
        # micro-batches (measured on gloo, PP=2 x VPP=2).
        provider.overlap_p2p_comm = True
        provider.batch_p2p_comm = False
    _set_fusions(provider, cfg, fused=on_cuda and use_te)
    if router_replay:
        provider.moe_enable_routing_replay = True
    if value_model:
        provider.share_embeddings_and_output_weights = False
    for name, value in (FULL_RECOMPUTE if recompute else {}).items():
        setattr(provider, name, value)
    _set_checked(provider, cfg.override_transformer_config, "override_transformer_config")
    provider.finalize()
    return provider


def make_ddp_config(cfg: McoreEngineConfig) -> Any:
    """Megatron's DistributedDataParallelConfig for ``cfg`` (Megatron-FSDP shards params, grads and
    optimizer)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    if cfg.use_megatron_fsdp:
        ddp.use_megatron_fsdp = True
        ddp.data_parallel_sharding_strategy = "optim_grads_params"
    _set_checked(ddp, cfg.override_ddp_config, "override_ddp_config")
    return ddp


def build_model(
    provider: Any, cfg: McoreEngineConfig, *, wrap_with_ddp: bool, on_cuda: bool, pre_wrap_hook: Any = None
) -> list[torch.nn.Module]:
    """Instantiate this rank's model chunks (one per virtual pipeline stage)."""
    kwargs = dict(
        wrap_with_ddp=wrap_with_ddp,
        use_cpu_initialization=not on_cuda,
        use_megatron_fsdp=cfg.use_megatron_fsdp and wrap_with_ddp,
        bf16=cfg.dtype == "bfloat16",
        fp16=cfg.dtype == "float16",
        pre_wrap_hook=pre_wrap_hook,
    )
    if wrap_with_ddp:
        kwargs["ddp_config"] = make_ddp_config(cfg)
    kwargs.update(cfg.override_mcore_model_config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*GPTModel IS DEPRECATED.*")
        chunks = provider.provide_distributed_model(**kwargs)
    if wrap_with_ddp and on_cuda and not cfg.use_megatron_fsdp:
        fuse_te_wgrad(chunks, provider, cfg)
    return chunks


def fuse_te_wgrad(
    chunks: list[torch.nn.Module], provider: Any, cfg: McoreEngineConfig, *, megatron_fsdp: bool = False
) -> int:
    """Transformer Engine's dense layers accumulate their weight gradients straight into Megatron DDP's fp32
    ``main_grad`` (TE's ``fuse_wgrad_accumulation``: the wgrad GEMM adds into the buffer) where
    ``gradient_accumulation_fusion`` is off only for want of APEX, whose kernel Megatron-Core's own output
    layer needs. Skipped where it is on already (APEX) or ``override_transformer_config`` sets it; only
    modules whose parameters all train and have a ``main_grad`` (LoRA's frozen bases do not). Returns how
    many modules it turned on. The engine calls it under Megatron DDP only: on the 1.5B bench it took the step
    from 0.2694 to 0.2525 s (BENCHMARKS.md). Megatron-FSDP takes TE's fusion too (TE >= 2.10), but attaches
    ``get_main_grad`` to the unsharded parameters it swaps in for forward and backward, not to the sharded ones
    the modules hold here, so with ``megatron_fsdp`` only ``requires_grad`` is checked; the bench's
    ``megatron_fsdp_wgrad`` tries it (with the attribute check it fused no module)."""
    if (
        provider.gradient_accumulation_fusion
        or "gradient_accumulation_fusion" in cfg.override_transformer_config
    ):
        return 0
    if not _deps.has_transformer_engine():
        return 0
    from transformer_engine.pytorch import LayerNormLinear, Linear

    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            params = list(module.parameters(recurse=False))
            if isinstance(module, (Linear, LayerNormLinear)) and params:
                # Megatron DDP gives a parameter its main_grad; Megatron-FSDP a get_main_grad, which TE calls
                if all(
                    p.requires_grad
                    and (megatron_fsdp or hasattr(p, "main_grad") or hasattr(p, "get_main_grad"))
                    for p in params
                ):
                    module.fuse_wgrad_accumulation = True
                    count += 1
    return count


def build_optimizer(chunks: list[torch.nn.Module], optim: OptimizerConfig, cfg: McoreEngineConfig) -> Any:
    """Megatron's (distributed) Adam over ``chunks``; the LR is driven by the engine's scheduler."""
    from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    dtype = parse_dtype(cfg.dtype)
    mcfg = MOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    if dtype == torch.float16:
        mcfg.loss_scale = None
        mcfg.initial_loss_scale = 2.0**16
    optimizer = get_megatron_optimizer(mcfg, chunks)
    _settle_grad_norm_groups(optimizer)
    return optimizer


def _settle_grad_norm_groups(optimizer: Any) -> None:
    """Run, on every rank now, the collective Megatron-Core's first gradient clipping would run only on ranks
    that hold trainable parameters.

    ``clip_grad_norm`` asks ``has_grad_norm_group(g)`` for each separately clipped group (an all-reduce over
    the grad-stats group, cached after the first call) only when the rank has parameters, so a pipeline stage
    with nothing to train (LoRA adapting only some layers) would leave the others waiting in that all-reduce.
    Asking here, on every rank, fills the cache everywhere."""
    from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

    for group in SEPARATE_GRAD_NORM_GROUPS:
        optimizer.has_grad_norm_group(group)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Megatron-FSDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON-able dump of a TransformerConfig (callables and tensors dropped)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, (str, int, float, bool)) or value is None:
            out[f.name] = value
        elif isinstance(value, torch.dtype):
            out[f.name] = str(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
            out[f.name] = list(value)
    return out
