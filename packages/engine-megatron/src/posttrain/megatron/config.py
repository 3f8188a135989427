"""``McoreEngineConfig``: the megatron engine's knobs on top of the shared :class:`EngineConfig`.

Registered as backend ``megatron`` (entry-point group ``posttrain.engines``); it builds the megatron engines.
Field names and defaults follow verl's ``McoreEngineConfig``. This module imports only engine-core's config:
resolving ``model_engine=megatron`` needs no megatron-core. Rules that need the HF model config or CUDA are in
:mod:`posttrain.megatron.rules`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config.checkpoint import CheckpointConfig
from posttrain.core.config.engine import EngineConfig


@dataclass(kw_only=True)
class McoreEngineConfig(EngineConfig):
    """Megatron-Core through Megatron-Bridge (``strategy`` megatron)."""

    engines: ClassVar[dict[str, str]] = {
        "language_model": "posttrain.megatron.engine:MegatronLanguageModelEngine",
        "value_model": "posttrain.megatron.engine:MegatronValueModelEngine",
    }

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
    vanilla_mbridge: bool = False
    """True = the deprecated standalone ``mbridge`` package; False = NVIDIA Megatron-Bridge."""
    use_megatron_fsdp: bool = False
    """ZeRO-3 sharding of params, grads and optimizer state through Megatron-FSDP."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """Save the distributed optimizer in the fully reshardable layout."""
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """Lower-memory variant of the fully reshardable layout."""
    portable_checkpoint: bool = False
    """Save model and optimizer keyed by HF names in the FSDP engine's layout (DCP, flattened AdamW state,
    LR scheduler state in extra), so the checkpoint resumes on either backend; false saves Megatron's
    native dist_ckpt. A load reads either layout whatever this says. Set it on each role that saves
    (actor, critic)."""
    hf_save_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for Megatron-Bridge's ``save_hf_weights`` when ``checkpoint.save_contents`` lists
    hf_model (e.g. distributed_save, strict, weight_dtype: bfloat16); a key that the installed bridge's
    ``save_hf_weights`` does not take is refused when the engine starts."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != "megatron":
            raise ValueError(f"McoreEngineConfig.strategy={self.strategy!r}: must be megatron")
        self._check_sizes()
        if self.vanilla_mbridge:
            warnings.warn(
                "engine.vanilla_mbridge=true selects the deprecated standalone mbridge package; "
                "set engine.vanilla_mbridge=false to use Megatron-Bridge",
                FutureWarning,
                stacklevel=1,
            )
            if self.portable_checkpoint:
                raise ValueError(
                    "engine.portable_checkpoint=true with engine.vanilla_mbridge=true: the portable "
                    "(HF-keyed) save uses Megatron-Bridge's conversion tasks, which the legacy mbridge "
                    "lacks; set engine.vanilla_mbridge=false or engine.portable_checkpoint=false"
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
        self._check_unimplemented()

    def _check_unimplemented(self) -> None:
        if self.pad_to_length and self.context_parallel_size > 1:
            raise ValueError(
                f"engine.pad_to_length=true with context_parallel_size={self.context_parallel_size} is not "
                "implemented (each CP rank's chunks are padded per sequence): set pad_to_length=false or "
                "context_parallel_size=1"
            )

    def _check_sizes(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "expert_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
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

    @property
    def token_multiple(self) -> int:
        """Each packed micro-batch is padded to a multiple of this many tokens: the TP size under sequence
        parallelism (the stream is split over the TP ranks), times 16 with TE's FP8 (32 for MXFP8; its GEMMs
        need token counts in those multiples, as Megatron-Core's ``get_fp8_align_size`` says), and a multiple
        of ``pad_to_length_bucket`` with ``pad_to_length``."""
        tf = self.override_transformer_config
        align = (32 if tf.get("fp8_recipe") == "mxfp8" else 16) if tf.get("fp8") else 1
        multiple = (self.tensor_model_parallel_size if self.sequence_parallel else 1) * align
        return math.lcm(multiple, self.pad_to_length_bucket) if self.pad_to_length else multiple

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
                "expert_model_parallel_size x expert_tensor_parallel_size = "
                f"{self.expert_model_parallel_size} x {etp} does not divide data-parallel x context-parallel "
                f"x tensor-parallel = {expert_span} (world size {world_size}): pick an "
                f"expert_model_parallel_size that divides {expert_span // etp}"
            )
        return dp

    def check_checkpoint(self, checkpoint: CheckpointConfig, role: str = "actor") -> None:
        """Megatron-FSDP saves DTensor state through Megatron-Bridge's fsdp_dtensor path, which async save
        does not cover. (An optimizer without the model is refused for every engine by
        ``CheckpointConfig``.)"""
        if not self.use_megatron_fsdp:
            return
        if checkpoint.async_save:
            raise ValueError(
                f"checkpoint.async_save=true with {role}.engine.use_megatron_fsdp=true is not supported "
                "by Megatron-FSDP checkpointing: set checkpoint.async_save=false"
            )
