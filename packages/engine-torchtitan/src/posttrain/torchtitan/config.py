"""``TorchTitanEngineConfig``: the torchtitan engine's knobs on top of the shared :class:`EngineConfig`.

Registered as backend ``torchtitan`` (entry-point group ``posttrain.engines``); :meth:`build` returns the
engine, initialised. This module imports only engine-core's config (no torchtitan).

Parallelisms of torchtitan 0.3.0 this engine does not have, and why (no field, so a key for them is refused by
the config loader): pipeline parallelism (torchtitan's schedules call one loss on the last stage over
equal-shape micro-batches; posttrain's losses take per-token log-probs of variable-length packed
micro-batches), context parallelism (torchtitan's CP runs SDPA / flex attention only and refuses its varlen
attention, which packed documents need), sequence parallelism (the packed attention needs whole rows on every
rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.core.config.engine import EngineConfig, normalize_dtype

AC_MODES = ("none", "full", "selective")


@dataclass(kw_only=True)
class TorchTitanEngineConfig(EngineConfig):
    """torchtitan's Qwen3 / Llama-3 models sharded by torchtitan's own FSDP2 (HSDP) function."""

    engines: ClassVar[dict[str, str]] = {
        "language_model": "posttrain.torchtitan.engine:TorchTitanLanguageModelEngine",
        "value_model": "posttrain.torchtitan.engine:TorchTitanValueModelEngine",
    }

    strategy: str | None = "torchtitan"
    """Always ``torchtitan`` (the backend name)."""
    fsdp_size: int = -1
    """Shard group size; -1 shards over all data-parallel ranks, a smaller divisor of their number gives HSDP
    (replicate x shard), as torchtitan's ``data_parallel_shard_degree``."""
    tp_size: int = 1
    """Tensor-parallel degree (torchtitan's ``tensor_parallel_degree``): attention heads, MLP columns and the
    vocabulary are split over groups of ``tp_size`` consecutive ranks by torchtitan's own sharding plan; it
    must divide the query and key/value heads and the world size. Data parallelism is world / tp_size."""
    ep_size: int = 1
    """Expert-parallel degree of a MoE model (torchtitan's ``expert_parallel_degree``): each sparse layer's
    experts are split over groups of ``ep_size`` data-parallel ranks, tokens reach their experts by
    all-to-all; it must divide the experts and the FSDP shard group. 1 keeps every expert on every rank
    (FSDP-sharded)."""
    model_dtype: str = "fp32"
    """Dtype of the master parameters (the optimizer's copy); FSDP2 computes in ``dtype``."""
    reshard_after_forward: str = "default"
    """torchtitan's ``fsdp_reshard_after_forward`` policy: ``default`` (every block but the last), ``always``
    or ``never``."""
    activation_checkpointing: str | None = None
    """torchtitan's activation checkpointing of each block: ``none``, ``full`` (recompute the block) or
    ``selective`` (save the matmul outputs, recompute the rest); null follows
    ``model.enable_gradient_checkpointing`` (full when true, none when false; chosen where null)."""
    compile: bool = False
    """``torch.compile`` each transformer block (torchtitan's ``apply_compile``); the first steps pay for
    it."""
    entropy_checkpointing: bool = True
    """Recompute each head chunk's fp32 softmax in backward instead of keeping it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != "torchtitan":
            raise ValueError(
                f"TorchTitanEngineConfig.strategy={self.strategy!r}: it is always torchtitan (another "
                "backend has its own engine config class)"
            )
        self.model_dtype = normalize_dtype(self.model_dtype, "engine.model_dtype")
        if self.tp_size < 1:
            raise ValueError(f"engine.tp_size={self.tp_size}: use 1 (no tensor parallelism) or more")
        if self.ep_size < 1:
            raise ValueError(f"engine.ep_size={self.ep_size}: use 1 (no expert parallelism) or more")
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError(
                f"engine.ep_size={self.ep_size} with engine.tp_size={self.tp_size}: the torchtitan engine "
                "runs MoE models without tensor parallelism; set engine.tp_size=1"
            )
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(f"engine.fsdp_size={self.fsdp_size}: use -1 (all ranks) or a positive divisor")
        if self.reshard_after_forward not in ("default", "always", "never"):
            raise ValueError(
                f"engine.reshard_after_forward={self.reshard_after_forward!r}: use default, always or never"
            )
        if self.activation_checkpointing is not None and self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"engine.activation_checkpointing={self.activation_checkpointing!r}: use one of "
                f"{', '.join(AC_MODES)}"
            )

    def check_world_size(self, world_size: int) -> int:
        """Check ``tp_size`` divides ``world_size`` and ``fsdp_size`` the data-parallel size; returns that."""
        if world_size % self.tp_size:
            raise ValueError(
                f"engine.tp_size={self.tp_size} does not divide the world size {world_size}: use a divisor "
                f"of {world_size}"
            )
        dp = world_size // self.tp_size
        if 0 < self.fsdp_size < dp and dp % self.fsdp_size:
            raise ValueError(
                f"engine.fsdp_size={self.fsdp_size} does not divide the data-parallel size {dp} (world "
                f"{world_size} / tp_size {self.tp_size}): use a divisor of {dp} or -1"
            )
        if self.fsdp_size == 1 and dp > 1:
            raise ValueError(
                f"engine.fsdp_size=1 on {dp} data-parallel ranks is pure replication, where FSDP2 (torch "
                "2.14) divides the gradients twice: use a shard group of at least 2 ranks (or -1)"
            )
        if self.fsdp_size > dp:
            raise ValueError(
                f"engine.fsdp_size={self.fsdp_size} exceeds the data-parallel size {dp}: use -1 or a divisor"
            )
        shard = self.fsdp_size if 0 < self.fsdp_size < dp else dp
        if shard % self.ep_size:
            raise ValueError(
                f"engine.ep_size={self.ep_size} does not divide the FSDP shard group of {shard} ranks (world "
                f"{world_size}, fsdp_size {self.fsdp_size}): use an ep_size that divides {shard}"
            )
        return dp

    def ac_mode(self, enable_gradient_checkpointing: bool) -> str:
        """The activation checkpointing mode in force (see :attr:`activation_checkpointing`)."""
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "full" if enable_gradient_checkpointing else "none"
