"""The engine config every training backend shares; each backend's own dataclass subclasses it in its package.

Field names and defaults follow verl's ``verl/workers/config/engine.py`` so a verl user's overrides carry over
after the ``<role>.engine.`` prefix (see docs/migrating-from-verl.md). A backend names its config class in the
``posttrain.engine_configs`` entry-point group (:func:`posttrain.core.registry.engine_config_class`), next to
its engines in ``posttrain.engines``; engine-core names no backend. Each class validates its own fields in
``__post_init__``; :meth:`EngineConfig.check_world_size` and :meth:`EngineConfig.check_checkpoint` are the
hooks for rules that need the world size or the checkpoint config.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoint import CheckpointConfig


def normalize_dtype(value: str, key: str) -> str:
    """The canonical torch name of a config dtype (:func:`posttrain.core.dtypes.dtype_name`, the one table)."""
    from ..dtypes import dtype_name

    return dtype_name(value, key)


@dataclass(kw_only=True)
class RouterReplayConfig:
    """MoE router replay: make the experts chosen in the update equal those chosen earlier."""

    mode: str = "disabled"
    """``disabled``; ``R2`` records routing in the log-prob pass and replays it in the update; ``R3`` replays
    the routing recorded by the rollout engine (needs ``rollout.return_routed_experts=true``) in the log-prob
    pass and the update. The routing travels as ``batch.fields["routed_experts"]`` (T, MoE layers, k).
    Implemented by the megatron engine (see docs/rl.md)."""
    record_file: str | None = None
    """verl's file to dump recorded routing to. posttrain keeps the routing in the batch, so only null is
    accepted."""
    replay_file: str | None = None
    """verl's file of routing to replay. posttrain replays the routing carried by the batch, so only null is
    accepted."""

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "R2", "R3"):
            raise ValueError(f"router_replay.mode={self.mode!r} is not supported: use disabled, R2 or R3")
        for key in ("record_file", "replay_file"):
            value = getattr(self, key)
            if value is not None:
                raise ValueError(
                    f"engine.router_replay.{key}={value!r} is not supported: posttrain keeps recorded routing in "
                    'memory, in batch.fields["routed_experts"], and never reads or writes routing files; '
                    f"set engine.router_replay.{key}=null (R3 takes the rollout's routing with "
                    "rollout.return_routed_experts=true)"
                )


_QAT_FIELDS = (
    "mode",
    "group_size",
    "ignore_patterns",
    "activation_observer",
    "quantization_config_path",
)


@dataclass(kw_only=True)
class QATConfig:
    """Quantisation-aware training: verl's block, accepted at its defaults only (posttrain has no QAT)."""

    enable: bool = False
    """Turn QAT on. posttrain does not implement QAT, so only false is accepted."""
    mode: str = "w4a16"
    """Quantisation scheme (only the default is accepted)."""
    group_size: int = 16
    """Quantisation group size (only the default is accepted)."""
    ignore_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    """Module name patterns left in full precision (only the default is accepted)."""
    activation_observer: str = "static_minmax"
    """Observer used for activation ranges (only the default is accepted)."""
    quantization_config_path: str | None = None
    """Path to a quantisation config file (only null is accepted)."""

    def __post_init__(self) -> None:
        fix = "train in bf16 and quantise the exported HF model afterwards"
        if self.enable:
            raise ValueError(
                f"engine.qat.enable=true: posttrain does not implement quantisation-aware training; {fix}"
            )
        for key in _QAT_FIELDS:
            value, expected = getattr(self, key), _qat_default(key)
            if value != expected:
                raise ValueError(
                    f"engine.qat.{key}={value!r}: posttrain does not implement quantisation-aware training, so the "
                    f"qat block only takes its defaults (here {expected!r}); remove the override ({fix})"
                )


def _qat_default(key: str) -> Any:
    spec = QATConfig.__dataclass_fields__[key]
    return spec.default if spec.default_factory is MISSING else spec.default_factory()


@dataclass(kw_only=True)
class EngineConfig:
    """What every backend understands. ``strategy`` names the backend in the engine registry."""

    strategy: str | None = None
    """Backend name (``fsdp``, ``fsdp2``, ``megatron`` or a third-party one). null: the run's
    ``model_engine``."""
    param_offload: bool | None = False
    """Keep parameters on the CPU outside train/eval contexts. null (the reference only): the RL trainer chooses
    from the model's size, the free device memory and the rollout's needs
    (:func:`posttrain.core.memory_policy.choose_ref_offload`) and logs the choice."""
    optimizer_offload: bool = False
    """Keep optimizer state on the CPU outside the train context."""
    grad_offload: bool = False
    """Keep gradients on the CPU after initialisation."""
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
    """verl's fused log-prob/entropy kernels. Only false is accepted: posttrain's heads compute log-probs and
    entropy from the hidden states chunk by chunk (``entropy_from_logits_chunk_size``), which is what those
    kernels are for."""
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
    seed: int = 42
    """Seed for parameter init and dropout."""
    full_determinism: bool = False
    """Deterministic kernels and seeded RNGs (:func:`posttrain.core.determinism.enable_full_determinism`):
    bitwise-repeatable steps, slower kernels; an op with no deterministic implementation raises."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE router replay (Megatron engine)."""
    qat: QATConfig = field(default_factory=QATConfig)
    """Quantisation-aware training (verl compatibility; not implemented, defaults only)."""

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
        for name in ("pad_to_length_bucket", "entropy_from_logits_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= 1")
        if self.use_fused_kernels:
            raise ValueError(
                "engine.use_fused_kernels=true: posttrain has no fused log-prob kernels; its engines already "
                "compute log-probs and entropy from the hidden states in chunks, never holding fp32 logits "
                "of a whole micro-batch. Set engine.use_fused_kernels=false (tune "
                "engine.entropy_from_logits_chunk_size instead)"
            )

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
