"""The engine config every training backend shares; each backend's own dataclass subclasses it in its package.

Field names and defaults follow verl's ``verl/workers/config/engine.py`` so a verl user's overrides carry over
after the ``<role>.engine.`` prefix (see docs/migrating-from-verl.md). A backend registers its config class
under its name in the ``posttrain.engines`` entry-point group (:mod:`posttrain.core.registry`); the class
names the engine it builds for each model type (:attr:`EngineConfig.engines`) and :meth:`EngineConfig.build`
returns it, initialised. engine-core names no backend. Each class validates its own fields in
``__post_init__``;
:meth:`EngineConfig.check_world_size` and :meth:`EngineConfig.check_checkpoint` are the hooks for rules that
need the world size or the checkpoint config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ..engine import BaseEngine
    from .checkpoint import CheckpointConfig
    from .model import ModelConfig
    from .optim import OptimizerConfig


def normalize_dtype(value: str, key: str) -> str:
    """The canonical torch name of a config dtype (:func:`posttrain.core.dtypes.dtype_name`, the one
    table)."""
    from ..dtypes import dtype_name

    return dtype_name(value, key)


def resolve_compute_dtype(config: EngineConfig) -> str:
    """Turn ``config.dtype=auto`` into bfloat16 when CUDA is available and float32 otherwise (a CPU has no
    fast bf16 matmuls and its tests compare against fp32 references), log the choice, and return the dtype."""
    if config.dtype == "auto":
        import torch

        config.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        logging.getLogger("posttrain").info(
            "engine.dtype=auto -> %s (%s)", config.dtype, "CUDA" if config.dtype == "bfloat16" else "no CUDA"
        )
    return config.dtype


@dataclass(kw_only=True)
class RouterReplayConfig:
    """MoE router replay: make the experts chosen in the update equal those chosen earlier."""

    mode: str = "disabled"
    """``disabled``; ``R2`` records routing in the log-prob pass and replays it in the update; ``R3`` replays
    the routing recorded by the rollout engine (needs ``rollout.return_routed_experts=true``) in the log-prob
    pass and the update. The routing travels as ``batch.fields["routed_experts"]`` (T, MoE layers, k).
    Implemented by the megatron engine (see docs/rl.md)."""

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "R2", "R3"):
            raise ValueError(f"router_replay.mode={self.mode!r} is not supported: use disabled, R2 or R3")


@dataclass(kw_only=True)
class EngineConfig:
    """What every backend understands. A backend's subclass fills :attr:`engines` and fixes ``strategy`` to
    the name it is registered under."""

    engines: ClassVar[dict[str, str]] = {}
    """model type (``language_model``, ``value_model``) -> ``module:Class`` of the engine this config
    builds."""

    strategy: str | None = None
    """Backend name (``fsdp``, ``fsdp2``, ``megatron`` or a third-party one), read once by the config loader
    to choose this config's class. null: the run's ``model_engine``."""
    param_offload: bool | None = False
    """Keep parameters on the CPU outside train/eval contexts. null (the reference only): the RL trainer
    chooses from the model's size, the free device memory and the rollout's needs
    (:func:`posttrain.core.memory_policy.choose_ref_offload`) and logs the choice."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU outside the train context."""
    grad_offload: bool = False
    """Keep gradients on the CPU after initialisation."""
    forward_only: bool = False
    """Build no optimizer, scheduler or checkpoint writer (e.g. the reference policy)."""
    dtype: str = "auto"
    """Compute dtype: bfloat16, float16, float32, or auto: bfloat16 when CUDA is available, float32 on a CPU
    (resolved, and logged, when the engine is built: :func:`resolve_compute_dtype`)."""
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
    use_remove_padding: bool = True
    """Run on packed sequences (no padding tokens computed)."""
    pad_to_length: bool = False
    """Pad each packed micro-batch up to a multiple of ``pad_to_length_bucket`` tokens (stable shapes)."""
    pad_to_length_bucket: int = 1024
    """Bucket for ``pad_to_length`` (verl's megatron default is 512)."""
    entropy_from_logits_with_chunking: bool = True
    """Compute log-probs and entropy ``entropy_from_logits_chunk_size`` tokens at a time. false: the whole
    micro-batch at once (fp32 logits of every token over the full vocabulary: far more memory). verl's default
    is false; posttrain's is true."""
    entropy_from_logits_chunk_size: int = 2048
    """Tokens per chunk of the log-prob/entropy head (bounds its fp32 working set)."""
    use_torch_compile: bool = True
    """Compile the log-prob/entropy head's per-chunk math on CUDA (fused passes over the logits instead of
    several fp32 ones); the first steps pay the compile time. Ignored on the CPU."""
    seed: int = 42
    """Seed for parameter init and dropout."""
    full_determinism: bool = False
    """Deterministic kernels and seeded RNGs (:func:`posttrain.core.determinism.enable_full_determinism`):
    bitwise-repeatable steps, slower kernels; an op with no deterministic implementation raises."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE router replay (Megatron engine)."""

    def __post_init__(self) -> None:
        if self.dtype != "auto":
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
        for name in ("pad_to_length_bucket", "entropy_from_logits_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= 1")

    def micro_batching(self, forward_only: bool) -> tuple[int | None, int | None]:
        """(token budget, sequences per micro-batch) for a training or a forward-only pass."""
        if forward_only:
            return (
                self.infer_max_token_len_per_gpu or self.max_token_len_per_gpu,
                self.infer_micro_batch_size_per_gpu or self.micro_batch_size_per_gpu,
            )
        return self.max_token_len_per_gpu, self.micro_batch_size_per_gpu

    def logits_chunk_size(self, num_tokens: int) -> int:
        """Rows per chunk of the log-prob/entropy head for a micro-batch of ``num_tokens`` tokens."""
        if self.entropy_from_logits_with_chunking:
            return self.entropy_from_logits_chunk_size
        return max(num_tokens, 1)

    def check_world_size(self, world_size: int) -> int:
        """Check the layout fits ``world_size`` ranks and return the data-parallel size (here: all ranks)."""
        return world_size

    def check_checkpoint(self, checkpoint: CheckpointConfig, role: str = "actor") -> None:
        """Raise a ValueError naming the fix when ``checkpoint`` asks for what this backend cannot save."""

    def engine_class(self, model_type: str = "language_model") -> type[BaseEngine]:
        """The engine class this config builds for ``model_type`` (imported now)."""
        from ..engine import BaseEngine
        from ..registry import load_target

        if model_type not in self.engines:
            have = ", ".join(sorted(self.engines)) or "none"
            raise ValueError(
                f"{type(self).__name__} (engine.strategy={self.strategy}) builds no {model_type} engine "
                f"(it builds: {have}): choose a backend that does"
            )
        cls = load_target(self.engines[model_type])
        if not (isinstance(cls, type) and issubclass(cls, BaseEngine)):
            raise TypeError(f"{self.engines[model_type]} is not a BaseEngine subclass")
        return cls

    def build(
        self,
        model_type: str = "language_model",
        *,
        model: ModelConfig,
        optim: OptimizerConfig,
        ckpt: CheckpointConfig,
    ) -> BaseEngine:
        """The ``model_type`` engine over ``model``, configured by this config, initialised."""
        engine = self.engine_class(model_type)(
            model_config=model, engine_config=self, optimizer_config=optim, checkpoint_config=ckpt
        )
        engine.initialize()
        return engine
