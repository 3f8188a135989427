"""Optimizer and learning-rate schedule config, and the schedule itself (shared by every engine).

The schedule is linear warmup from 0 to ``lr`` over the warmup steps, then ``constant``, ``cosine`` or
``linear`` decay to ``min_lr`` at ``total_training_steps``. It returns a multiplier of ``lr`` so it plugs into
``torch.optim.lr_scheduler.LambdaLR``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY_STYLES = ("constant", "cosine", "linear")


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW and its schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 or less: no clipping, the norm is still reported)."""
    lr_warmup_steps: int = -1
    """Warmup steps; -1 uses ``lr_warmup_steps_ratio`` x total steps."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a fraction of the total steps (when ``lr_warmup_steps`` is -1)."""
    total_training_steps: int = -1
    """Steps the schedule spans; -1 lets the trainer fill it in."""
    lr_decay_style: str = "constant"
    """After warmup: constant, cosine or linear decay to ``min_lr``."""
    min_lr: float = 0.0
    """Final learning rate of the cosine/linear decay."""
    max_skipped_steps_in_a_row: int = 3
    """An optimizer step whose gradient norm is NaN or inf is skipped (and counted); this many skipped in a
    row stop the run with an error naming the first non-finite gradient or weight. 0: never stop."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(
                f"optim.lr_decay_style={self.lr_decay_style!r} is unknown: use one of "
                f"{', '.join(DECAY_STYLES)}"
            )
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas={list(self.betas)} must have two values, e.g. [0.9, 0.999]")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio={self.lr_warmup_steps_ratio} must be in [0, 1]")
        if self.max_skipped_steps_in_a_row < 0:
            raise ValueError(
                f"optim.max_skipped_steps_in_a_row={self.max_skipped_steps_in_a_row} must be >= 0 (0: never "
                "stop)"
            )
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} must be >= 0")

    def warmup_steps(self, total_steps: int) -> int:
        """Number of warmup steps for a run of ``total_steps``."""
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * max(total_steps, 0))

    def lr_multiplier(self, step: int, total_steps: int | None = None) -> float:
        """``lr(step) / lr``: warmup, then the decay style. ``step`` counts optimizer steps from 0."""
        total = total_steps if total_steps is not None else self.total_training_steps
        warmup = self.warmup_steps(total)
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if self.lr_decay_style == "constant" or total is None or total <= warmup or self.lr == 0:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        floor = self.min_lr / self.lr
        if self.lr_decay_style == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
