"""Trainer loop config: length, evaluation, logging, checkpoint cadence and resume (:class:`TrainerConfig`,
what SFT reads); :class:`RLTrainerConfig` adds the RL keys (``trainer.mode``...) under the same ``trainer``
node."""

from __future__ import annotations

from dataclasses import dataclass, field

from .rl.mode_config import RolloutModeConfig

LOGGERS = ("console", "file", "tensorboard", "wandb", "mlflow")


@dataclass(kw_only=True)
class TrainerConfig:
    """How long to train, how often to validate and save, where to write."""

    project_name: str = "posttrain"
    """Project name for loggers."""
    experiment_name: str = "run"
    """Run name for loggers."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """Any of console, file (metrics.jsonl), tensorboard, wandb (offline works), mlflow."""
    total_epochs: int = 1
    """Passes over the training set."""
    total_training_steps: int | None = None
    """Stop after this many steps (overrides total_epochs when set)."""
    test_freq: int = -1
    """Validate every this many steps (-1: only at the end)."""
    save_freq: int = -1
    """Checkpoint every this many steps (-1: only at the end)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    default_local_dir: str = "checkpoints/posttrain/run"
    """Where checkpoints, metrics.jsonl and plots go."""
    resume_mode: str = "auto"
    """auto (newest complete checkpoint in default_local_dir), disable, or resume_path."""
    resume_from_path: str | None = None
    """A global_step_N directory, with resume_mode=resume_path."""
    nnodes: int = 1
    """Nodes in the run."""
    n_gpus_per_node: int = 1
    """Processes per node (GPUs, or CPU processes under torchrun)."""
    seed: int = 1
    """Seed of torch's global RNG at start-up (model init), of every step's rollout sampling (mixed with
    ``rollout.seed``) and of the mini-batch shuffles; the data order has its own ``data.seed``."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for perf/mfu; None looks known GPUs up (a CPU run reports no MFU)."""

    def __post_init__(self) -> None:
        unknown = [x for x in self.logger if x not in LOGGERS]
        if unknown:
            raise ValueError(
                f"trainer.logger={list(self.logger)} has unknown backend(s) {unknown}: choose from "
                f"{', '.join(LOGGERS)}"
            )
        if self.resume_mode not in ("auto", "disable", "resume_path"):
            raise ValueError(f"trainer.resume_mode={self.resume_mode!r}: use auto, disable or resume_path")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError(
                "trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>"
            )
        if self.nnodes < 1 or self.n_gpus_per_node < 1:
            raise ValueError(
                f"trainer.nnodes={self.nnodes} and trainer.n_gpus_per_node={self.n_gpus_per_node} "
                "must be >= 1"
            )
        if self.total_training_steps is not None and self.total_training_steps < 1:
            raise ValueError(f"trainer.total_training_steps={self.total_training_steps} must be >= 1 or null")
        if self.total_epochs < 1:
            raise ValueError(f"trainer.total_epochs={self.total_epochs} must be >= 1")


@dataclass(kw_only=True)
class RLTrainerConfig(TrainerConfig, RolloutModeConfig):
    """:class:`TrainerConfig` plus, for PPO / GRPO, how the rollout interleaves with training (inherited:
    ``mode``, ``max_staleness``...) and the critic warm-up."""

    critic_warmup: int = 0
    """PPO: update only the critic for this many steps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_mode()
        if self.critic_warmup < 0:
            raise ValueError(f"trainer.critic_warmup={self.critic_warmup} must be >= 0")
