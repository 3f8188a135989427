"""Engine configs: the knobs shared by every training backend, and one dataclass per backend.

Field names and defaults follow verl's ``verl/workers/config/engine.py`` so a verl user's overrides carry over
after the ``<role>.engine.`` prefix (see docs/migrating-from-verl.md). Each class validates its own fields in
``__post_init__``; rules that need two configs at once live in :mod:`posttrain.core.config.rules`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def normalize_dtype(value: str, key: str) -> str:
    """Map ``bf16``/``fp16``/``fp32`` spellings onto torch names; raise on anything else."""
    name = _DTYPE_ALIASES.get(value, value)
    if name not in DTYPES:
        raise ValueError(f"{key}={value!r} is not supported: use one of {', '.join(DTYPES)}")
    return name


@dataclass(kw_only=True)
class RouterReplayConfig:
    """MoE router replay: make the experts chosen in the update equal those chosen earlier."""

    mode: str = "disabled"
    """``disabled``; ``R2`` records routing in the log-prob pass and replays it in the update; ``R3`` replays
    the routing recorded by the rollout engine (needs ``rollout.return_routed_experts=true``) in the log-prob
    pass and the update. The routing travels as ``batch.fields["routed_experts"]`` (T, MoE layers, k).
    Implemented by the megatron engine (see docs/rl.md)."""
    record_file: str | None = None
    """Optional file to dump recorded routing decisions to (for debugging). Not read by any engine yet."""
    replay_file: str | None = None
    """Optional file of routing decisions to replay instead of the in-memory record. Not read by any engine
    yet."""

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "R2", "R3"):
            raise ValueError(f"router_replay.mode={self.mode!r} is not supported: use disabled, R2 or R3")


@dataclass(kw_only=True)
class QATConfig:
    """Quantisation-aware training (verl field, kept for override compatibility; not implemented)."""

    enable: bool = False
    """Turn QAT on. posttrain does not implement QAT yet, so True is rejected."""
    mode: str = "w4a16"
    """Quantisation scheme."""
    group_size: int = 16
    """Quantisation group size."""
    ignore_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    """Module name patterns left in full precision."""
    activation_observer: str = "static_minmax"
    """Observer used for activation ranges."""
    quantization_config_path: str | None = None
    """Optional path to a quantisation config file."""

    def __post_init__(self) -> None:
        if self.enable:
            raise ValueError("qat.enable=true is not supported by posttrain yet: set qat.enable=false")


@dataclass(kw_only=True)
class EngineConfig:
    """What every backend understands. ``strategy`` picks the backend in the engine registry."""

    strategy: str | None = None
    """Backend name: ``fsdp``, ``fsdp2`` or ``megatron``. Set for all roles at once by ``model_engine=``."""
    param_offload: bool = False
    """Keep parameters on the CPU outside train/eval contexts."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU outside the train context."""
    grad_offload: bool = False
    """Keep gradients on the CPU outside the train context."""
    forward_only: bool = False
    """Build no optimizer, scheduler or checkpoint writer (e.g. the reference policy)."""
    dtype: str = "bfloat16"
    """Compute dtype: bfloat16, float16 or float32 (float32 for CPU tests)."""
    use_dynamic_bsz: bool = True
    """Split micro-batches by token budget (``max_token_len_per_gpu``) instead of by sequence count."""
    max_token_len_per_gpu: int | None = None
    """Token budget of one training micro-batch when ``use_dynamic_bsz``."""
    micro_batch_size_per_gpu: int | None = None
    """Sequences per training micro-batch when not ``use_dynamic_bsz``."""
    infer_max_token_len_per_gpu: int | None = None
    """Token budget of one forward-only micro-batch (defaults to ``max_token_len_per_gpu``)."""
    infer_micro_batch_size_per_gpu: int | None = None
    """Sequences per forward-only micro-batch (defaults to ``micro_batch_size_per_gpu``)."""
    use_fused_kernels: bool = False
    """Use fused log-prob/entropy kernels where the backend has them."""
    use_remove_padding: bool = True
    """Run on packed sequences (no padding tokens computed)."""
    seed: int = 42
    """Seed for parameter init and dropout."""
    full_determinism: bool = False
    """Request deterministic kernels (slower)."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE router replay (Megatron engine)."""

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype, "engine.dtype")
        for name in (
            "max_token_len_per_gpu",
            "micro_batch_size_per_gpu",
            "infer_max_token_len_per_gpu",
            "infer_micro_batch_size_per_gpu",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(
                    f"engine.{name}={value} must be a positive integer (or null to use the default)"
                )

    def micro_batching(self, forward_only: bool) -> tuple[int | None, int | None]:
        """(token budget, sequences per micro-batch) for a training or a forward-only pass."""
        if forward_only:
            return (
                self.infer_max_token_len_per_gpu or self.max_token_len_per_gpu,
                self.infer_micro_batch_size_per_gpu or self.micro_batch_size_per_gpu,
            )
        return self.max_token_len_per_gpu, self.micro_batch_size_per_gpu


@dataclass(kw_only=True)
class FSDPEngineConfig(EngineConfig):
    """PyTorch FSDP over a Hugging Face model (``strategy`` fsdp = FSDP1, fsdp2 = ``fully_shard``)."""

    strategy: str | None = "fsdp2"
    """``fsdp`` (FSDP1, FlatParameter) or ``fsdp2`` (per-parameter DTensor sharding)."""
    wrap_policy: dict[str, Any] = field(default_factory=lambda: {"min_num_params": 0})
    """FSDP1 auto-wrap policy; decoder layers are always wrapped."""
    offload_policy: bool = False
    """FSDP2 ``CPUOffloadPolicy``: parameters live on the CPU and stream to the device per layer."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each layer's forward (ZeRO-3); False keeps them (ZeRO-2 like)."""
    fsdp_size: int = -1
    """Shard group size; -1 shards over all ranks, a smaller value gives HSDP (replicate x shard)."""
    forward_prefetch: bool = False
    """FSDP1 forward prefetch."""
    model_dtype: str = "fp32"
    """Dtype of the master parameters (the optimizer's copy)."""
    use_orig_params: bool = False
    """FSDP1 ``use_orig_params``."""
    mixed_precision: dict[str, str] | None = None
    """``param_dtype``/``reduce_dtype``/``buffer_dtype``; None = params in ``dtype``, reductions fp32."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallel degree (only 1 is implemented)."""
    entropy_from_logits_with_chunking: bool = False
    """verl compatibility; this engine's head always works in chunks of ``entropy_from_logits_chunk_size``
    tokens, with or without it."""
    use_torch_compile: bool = True
    """Compile the log-prob/entropy head's per-chunk function on CUDA."""
    entropy_checkpointing: bool = False
    """verl compatibility; this engine's head always recomputes each chunk's fp32 softmax in backward (so no
    fp32 full-vocabulary logits of a whole micro-batch are ever kept), with or without it."""
    compile_layers: bool = False
    """``torch.compile`` each decoder layer on CUDA (fuses norms, RoPE and the MLP's elementwise ops; dynamic
    token counts, so one compile serves every packed length). The first steps pay the compile time."""
    pad_to_length: bool = False
    """Pad packed micro-batches up to a multiple of ``pad_to_length_bucket`` tokens (stable shapes)."""
    pad_to_length_bucket: int = 1024
    """Bucket for ``pad_to_length``."""
    entropy_from_logits_chunk_size: int = 2048
    """Tokens per chunk in the log-prob/entropy head (bounds fp32 full-vocabulary logits)."""
    qat: QATConfig = field(default_factory=QATConfig)
    """Quantisation-aware training (not implemented)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy not in ("fsdp", "fsdp2"):
            raise ValueError(
                f"FSDPEngineConfig.strategy={self.strategy!r}: use fsdp or fsdp2 "
                "(for megatron the engine config is McoreEngineConfig)"
            )
        self.model_dtype = normalize_dtype(self.model_dtype, "engine.model_dtype")
        if self.ulysses_sequence_parallel_size != 1:
            raise ValueError(
                f"engine.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} is not "
                "implemented: set it to 1 (use the megatron engine's context_parallel_size for long "
                "sequences)"
            )
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(
                f"engine.fsdp_size={self.fsdp_size}: use -1 (all ranks) or a positive divisor of "
                "the world size"
            )


@dataclass(kw_only=True)
class McoreEngineConfig(EngineConfig):
    """Megatron-Core through Megatron-Bridge (``strategy`` megatron)."""

    strategy: str | None = "megatron"
    """Always ``megatron``."""
    tensor_model_parallel_size: int = 1
    """TP degree."""
    expert_model_parallel_size: int = 1
    """EP degree (MoE)."""
    expert_tensor_parallel_size: int | None = None
    """TP degree inside experts; None = same as TP."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None = 1."""
    context_parallel_size: int = 1
    """CP degree (long sequences)."""
    sequence_parallel: bool = True
    """Shard activations along the sequence in TP regions; forced off (with a warning) when TP=1."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1); required by Megatron-FSDP."""
    use_dist_checkpointing: bool = False
    """Load initial weights from a Megatron dist_ckpt instead of Hugging Face safetensors."""
    dist_checkpointing_path: str | None = None
    """Where that dist_ckpt lives."""
    dist_checkpointing_prefix: str = ""
    """Key prefix inside that dist_ckpt."""
    override_ddp_config: dict[str, Any] = field(default_factory=dict)
    """Fields set on Megatron's DistributedDataParallelConfig."""
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    """Fields set on the bridge's model provider / TransformerConfig."""
    override_mcore_model_config: dict[str, Any] = field(default_factory=dict)
    """Fields set on the model build call."""
    use_mbridge: bool = True
    """Build models through a bridge (always true in posttrain)."""
    vanilla_mbridge: bool = False
    """True = the deprecated standalone ``mbridge`` package; False = NVIDIA Megatron-Bridge."""
    use_megatron_fsdp: bool = False
    """ZeRO-3 sharding of params, grads and optimizer state through Megatron-FSDP."""
    dynamic_context_parallel: bool = False
    """Choose the CP degree per micro-batch (verl field; not implemented)."""
    max_seqlen_per_dp_cp_rank: int | None = None
    """Token cap per DP x CP rank under dynamic CP."""
    entropy_from_logits_with_chunking: bool = False
    """verl compatibility; this engine computes log-probs and entropy in chunks of
    ``entropy_from_logits_chunk_size`` tokens, each recomputed in backward, with or without it."""
    entropy_from_logits_chunk_size: int = 2048
    """Tokens per chunk of the vocab-parallel log-prob/entropy head (bounds its fp32 working set)."""
    pad_bshd_to_minibatch_max: bool = True
    """verl compatibility; this engine always packs micro-batches (THD), so there is no BSHD padding to do."""
    pad_to_length: bool = False
    """Pad packed micro-batches to a multiple of ``pad_to_length_bucket`` tokens."""
    pad_to_length_bucket: int = 512
    """Bucket for ``pad_to_length``."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """Save the distributed optimizer in the fully reshardable layout."""
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """Lower-memory variant of the fully reshardable layout."""
    qat: QATConfig = field(default_factory=QATConfig)
    """Quantisation-aware training (not implemented)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != "megatron":
            raise ValueError(f"McoreEngineConfig.strategy={self.strategy!r}: must be megatron")
        self._check_sizes()
        if not self.use_mbridge:
            raise ValueError(
                "engine.use_mbridge=false is not supported: posttrain builds Megatron models only "
                "through a bridge; set engine.use_mbridge=true"
            )
        if self.vanilla_mbridge:
            warnings.warn(
                "engine.vanilla_mbridge=true selects the deprecated standalone mbridge package; "
                "set engine.vanilla_mbridge=false to use Megatron-Bridge",
                FutureWarning,
                stacklevel=1,
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn(
                "engine.sequence_parallel=true has no effect at tensor_model_parallel_size=1; turning it off",
                UserWarning,
                stacklevel=1,
            )
            self.sequence_parallel = False
        if self.use_megatron_fsdp and not self.use_distributed_optimizer:
            raise ValueError(
                "engine.use_megatron_fsdp=true needs engine.use_distributed_optimizer=true "
                "(Megatron-FSDP shards optimizer state itself): set engine.use_distributed_optimizer=true"
            )
        if self.dynamic_context_parallel:
            raise ValueError("engine.dynamic_context_parallel=true is not implemented: set it to false")

    def _check_sizes(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "expert_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "entropy_from_logits_chunk_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= 1")
        for name in ("expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"engine.{name}={value} must be >= 1 or null")

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that hold one copy of the model."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def check_world_size(self, world_size: int) -> int:
        """Check the layout fits ``world_size`` ranks and return the data-parallel size."""
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = "
                f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size} x "
                f"{self.context_parallel_size} = {mp} does not divide the world size {world_size}: "
                f"choose sizes whose product divides {world_size}"
            )
        dp = world_size // mp
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert_span = dp * self.context_parallel_size * self.tensor_model_parallel_size
        if expert_span % (self.expert_model_parallel_size * etp):
            raise ValueError(
                f"expert_model_parallel_size x expert_tensor_parallel_size = {self.expert_model_parallel_size} x "
                f"{etp} does not divide data-parallel x context-parallel x tensor-parallel = {expert_span} "
                f"(world size {world_size}): pick an expert_model_parallel_size that divides {expert_span // etp}"
            )
        return dp


ENGINE_CONFIGS: dict[str, type[EngineConfig]] = {
    "fsdp": FSDPEngineConfig,
    "fsdp2": FSDPEngineConfig,
    "megatron": McoreEngineConfig,
}
"""Which config dataclass a strategy name uses (the trainer config picks a role's engine type by this)."""


def engine_config_class(strategy: str) -> type[EngineConfig]:
    """The dataclass for ``strategy``, or a ValueError listing the strategies there are."""
    try:
        return ENGINE_CONFIGS[strategy]
    except KeyError:
        raise ValueError(
            f"engine strategy {strategy!r} is unknown: use one of {', '.join(ENGINE_CONFIGS)}"
        ) from None
