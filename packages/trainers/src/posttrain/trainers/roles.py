"""Per-role configs: the actor, the reference policy and the critic each own an engine and an optimizer.

``<role>.engine`` is declared as the shared :class:`~posttrain.core.config.EngineConfig`; the config loader
puts the config class of the role's backend there (its ``strategy``, else ``model_engine``), e.g.
``posttrain.fsdp.config.FSDP2EngineConfig`` or ``posttrain.megatron.config.McoreEngineConfig``.
Batch sizes follow verl: ``ppo_mini_batch_size`` counts prompts over all data-parallel ranks (multiplied by
``rollout.n`` inside the trainer); ``*_micro_batch_size_per_gpu`` counts sequences on one rank. With
``use_dynamic_bsz`` (the default) and no ``max_token_len_per_gpu``, the trainers give each role's engine
:func:`fill_token_budget`'s budget: verl's 16384 tokens, or the run's longest sequence when that is longer (the
RL trainer on a GPU first tries a smaller budget where that one would need recomputation:
:mod:`posttrain.trainers.rl.auto_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.config import EngineConfig, ModelConfig, OptimizerConfig

from .algorithms import ActorLossConfig, CriticLossConfig

DEFAULT_MAX_TOKEN_LEN_PER_GPU = 16384
"""Token budget of a micro-batch when none is set (verl's ``ppo_max_token_len_per_gpu`` default)."""


def fill_token_budget(engine: EngineConfig, longest: int) -> None:
    """Give ``engine`` a micro-batch token budget when ``use_dynamic_bsz`` has none:
    ``max(DEFAULT_MAX_TOKEN_LEN_PER_GPU, longest)``, so the run's longest sequence (``longest`` tokens)
    fits."""
    if engine.use_dynamic_bsz and engine.max_token_len_per_gpu is None:
        engine.max_token_len_per_gpu = max(DEFAULT_MAX_TOKEN_LEN_PER_GPU, longest)


@dataclass(kw_only=True)
class SFTActorConfig:
    """The model being trained: its engine and optimizer (all an SFT run's ``actor`` holds)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend and its parallel layout."""
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""


@dataclass(kw_only=True)
class ActorConfig(ActorLossConfig, SFTActorConfig):
    """The policy being trained: its engine, optimizer, PPO batching and (inherited) loss knobs."""

    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (global); each prompt brings rollout.n responses."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    shuffle: bool = False
    """Shuffle sequences between mini-batches."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ppo_mini_batch_size < 1 or self.ppo_epochs < 1:
            raise ValueError(
                f"actor.ppo_mini_batch_size={self.ppo_mini_batch_size} and actor.ppo_epochs="
                f"{self.ppo_epochs} must be >= 1"
            )


@dataclass(kw_only=True)
class RefConfig:
    """The frozen reference policy for the KL term (a LoRA actor serves as its own reference)."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(forward_only=True))
    """Backend of the reference model (forward only)."""


@dataclass(kw_only=True)
class CriticConfig(CriticLossConfig):
    """The value model (GAE only): its model, engine, optimizer, batching and (inherited) loss knobs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Critic model; an empty path means the actor's model with a fresh value head."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Training backend of the critic."""
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int = 8
    """Prompts per critic optimizer step (global)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
