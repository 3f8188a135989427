"""The FSDP engines' configs: :class:`FSDPEngineConfig` (the knobs both share, on top
of :class:`EngineConfig`) and one class per variant, :class:`FSDP1EngineConfig` (backend ``fsdp``)
and :class:`FSDP2EngineConfig` (``fsdp2``), each registered under its name in the ``posttrain.engines``
entry-point group.
Field names and defaults follow verl's ``FSDPEngineConfig`` except where a docstring says otherwise. This
module imports only engine-core's config (no transformers, no FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config.engine import EngineConfig, normalize_dtype


@dataclass(kw_only=True)
class WrapPolicy:
    """Which modules FSDP shards as a unit (verl's ``wrap_policy`` keys)."""

    transformer_layer_cls_to_wrap: list[str] | None = None
    """Class names of the modules to wrap (each one an FSDP unit); null: the model's ``_no_split_modules``
    (its decoder layers)."""
    min_num_params: int = 0
    """FSDP1 only: when > 0, wrap by size instead (``size_based_auto_wrap_policy``: every subtree of at
    least this many parameters)."""

    def __post_init__(self) -> None:
        if self.min_num_params < 0:
            raise ValueError(f"wrap_policy.min_num_params={self.min_num_params} must be >= 0")
        if self.transformer_layer_cls_to_wrap is not None and not self.transformer_layer_cls_to_wrap:
            raise ValueError(
                "wrap_policy.transformer_layer_cls_to_wrap=[] wraps nothing: name the decoder-layer classes "
                "or set it to null for the model's _no_split_modules"
            )


@dataclass(kw_only=True)
class FSDPEngineConfig(EngineConfig):
    """PyTorch FSDP over a Hugging Face model: the knobs FSDP1 and FSDP2 share. Build one of its variants,
    :class:`FSDP1EngineConfig` or :class:`FSDP2EngineConfig`."""

    engines: ClassVar[dict[str, str]] = {
        "language_model": "posttrain.fsdp.engine:FSDPLanguageModelEngine",
        "value_model": "posttrain.fsdp.engine:FSDPValueModelEngine",
    }
    variant: ClassVar[str | None] = None
    """The strategy a variant class is fixed to (None: the base takes fsdp or fsdp2, for code that builds it
    by hand; the config loader always picks a variant)."""

    strategy: str | None = "fsdp2"
    """``fsdp`` (FSDP1, FlatParameter) or ``fsdp2`` (per-parameter DTensor sharding): fixed by the variant
    class."""
    wrap_policy: WrapPolicy = field(default_factory=WrapPolicy)
    """What becomes an FSDP unit (decoder layers by default)."""
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
    entropy_checkpointing: bool = True
    """Recompute each head chunk's fp32 softmax in backward, keeping only its logits in the compute dtype.
    false keeps the fp32 intermediates of every chunk (faster backward, more memory). verl's default is false;
    posttrain's is true."""
    compile_layers: bool = False
    """``torch.compile`` each decoder layer on CUDA (fuses norms, RoPE and the MLP's elementwise ops; dynamic
    token counts, so one compile serves every packed length). The first steps pay the compile time."""
    fused_rms_norm: bool = True
    """Swap the HF RMSNorm modules of llama, mistral, qwen2, qwen2_moe, qwen3 and qwen3_moe models for
    :class:`posttrain.fsdp.norms.FusedRMSNorm` when the model is built (logged): HF's math and roundings
    through ``torch.nn.functional.rms_norm``, one kernel each way on CUDA instead of eight forward and about
    sixteen backward per norm. Other model types keep HF's modules (also logged). false: HF's modules for
    every model."""

    def __post_init__(self) -> None:
        super().__post_init__()
        allowed = (self.variant,) if self.variant else ("fsdp", "fsdp2")
        if self.strategy not in allowed:
            raise ValueError(
                f"{type(self).__name__}.strategy={self.strategy!r}: use {' or '.join(allowed)} "
                "(FSDP1EngineConfig is fsdp, FSDP2EngineConfig fsdp2; another backend has its own engine "
                "config class)"
            )
        self.model_dtype = normalize_dtype(self.model_dtype, "engine.model_dtype")
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(
                f"engine.fsdp_size={self.fsdp_size}: use -1 (all ranks) or a positive divisor of "
                "the world size"
            )
        if self.wrap_policy.min_num_params > 0 and self.strategy == "fsdp2":
            raise ValueError(
                f"engine.wrap_policy.min_num_params={self.wrap_policy.min_num_params} with strategy=fsdp2: "
                "size-based wrapping is an FSDP1 auto-wrap policy; fully_shard wraps by class. Use "
                "wrap_policy.transformer_layer_cls_to_wrap, or strategy=fsdp"
            )

    def sharded_layout(self) -> str:
        """The name of the :mod:`posttrain.fsdp.layout` class that shards under a process group:
        ``FSDP1Layout`` for strategy fsdp, ``FSDP2Layout`` otherwise (without a group the engine runs
        ``PlainLayout``)."""
        return "FSDP1Layout" if self.strategy == "fsdp" else "FSDP2Layout"

    def check_world_size(self, world_size: int) -> int:
        """Check ``fsdp_size`` divides ``world_size``; every rank is a data-parallel rank."""
        if 0 < self.fsdp_size < world_size and world_size % self.fsdp_size:
            raise ValueError(
                f"engine.fsdp_size={self.fsdp_size} does not divide the world size {world_size}: use a "
                f"divisor of {world_size} or -1"
            )
        return world_size


@dataclass(kw_only=True)
class FSDP1EngineConfig(FSDPEngineConfig):
    """FSDP1 (``FullyShardedDataParallel`` over FlatParameters, decoder-layer or size-based auto-wrap)."""

    variant: ClassVar[str] = "fsdp"
    strategy: str | None = "fsdp"
    """``fsdp``."""


@dataclass(kw_only=True)
class FSDP2EngineConfig(FSDPEngineConfig):
    """FSDP2 (``fully_shard``: per-parameter DTensor sharding of each decoder layer and the root)."""

    variant: ClassVar[str] = "fsdp2"
    strategy: str | None = "fsdp2"
    """``fsdp2``."""
