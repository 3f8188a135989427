"""Which SFT checkpoint ``posttrain demo`` starts GRPO from (``sft_pick``), and SFT that stops there.

GRPO learns only from groups whose episodes differ in reward: a group of ``rollout.n`` episodes of one prompt
that all succeed, or all fail, has zero advantage. On the calculator task the SFT model's greedy success stays
at 0 on a loss plateau while the model has the format but does not yet copy the operands and the tool's
result, then rises from about 0.1 to about 0.75 within 30 to 40 steps, at a step that varies with the seed
(measured, cosine schedule over 800 steps: 0.10 at step 800 with seed 0, above 0.5 at steps 600 and 650 with
seeds 1 and 2). The share of groups with mixed rewards (8 episodes at the GRPO stage's temperature 0.5, 48
training prompts) follows the rise: 0.52 to 0.62 at checkpoints with greedy validation success 0.3 to 0.6,
0.19 to 0.31 at 0.7, 0.08 at 0.78, because the model is then nearly deterministic on the questions it trained
on. GRPO from a 0.47 checkpoint raised held-out success to 0.83 and 0.78 in 20 steps (seeds 0 and 1); from the
0.82 and 0.79 checkpoints of the same runs 50 steps later it left them at 0.81 and 0.78. A fixed SFT step
count therefore ends either before the rise (nothing to reinforce) or after it (nothing left to tell apart).

So the demo's SFT saves every :data:`SAVE_EVERY` steps, scores each checkpoint as it is saved by its greedy
success on validation questions (neither trained on nor in the held-out test set), and stops at the first
whose success reaches ``sft_pick`` (:class:`StopAtPick`); GRPO starts from it, or from the last step when none
reaches it within ``sft_steps``. Ten steps apart, successive checkpoints differed by at most 0.3 in the rise,
so a pick at ``sft_pick=0.3`` lands between 0.3 and about 0.6. Scoring runs the GRPO trainer's own validation
path (:class:`~posttrain.trainers.rl.generation.RolloutSampler` with the same config tree), so a checkpoint's
score is what GRPO's step-0 validation would report on those questions.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.core.config.loader import ConfigError

from . import preflight, threads
from .config import SFTConfig, load_config
from .sft import SFTTrainer

SAVE_EVERY = 10
"""SFT steps between the checkpoints the picker scores (the last step is always saved too)."""


def check_sft_pick(value: float) -> float:
    """``value`` as a float, or a :class:`ConfigError` (a ValueError) naming the fix when it is not a success
    rate in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise ConfigError(
            f"sft_pick={value!r} is not a success rate in (0, 1]: set e.g. sft_pick=0.3 (GRPO starts from "
            "the first SFT checkpoint whose greedy validation success reaches it), or sft_pick=1 to train "
            "all sft_steps unless a checkpoint is perfect"
        )
    return float(value)


@dataclass(frozen=True)
class Pick:
    """The checkpoint GRPO starts from and why."""

    step: int
    """Its SFT step."""
    scores: dict[int, float] = field(default_factory=dict)
    """Greedy validation success of each checkpoint scored, by step (in order; scoring stops at the pick)."""
    reason: str = ""
    """One line: what was picked and why."""


class Picker:
    """Scores checkpoints as they are offered, in step order, until one reaches the threshold."""

    def __init__(self, score: Callable[[int], float], threshold: float) -> None:
        """``score(step)``: the greedy validation success of the checkpoint of ``step``; ``threshold``:
        ``sft_pick``, checked here (a ValueError naming the fix)."""
        self.score = score
        self.threshold = check_sft_pick(threshold)
        self.scores: dict[int, float] = {}
        self.picked: int | None = None

    def offer(self, step: int) -> bool:
        """Score the checkpoint of ``step``; True when it reaches the threshold (then it is the pick and no
        later checkpoint need be offered)."""
        if self.picked is not None:
            raise ValueError(f"step {step} offered after the pick (step {self.picked})")
        if self.scores and step <= max(self.scores):
            raise ValueError(f"step {step} offered after step {max(self.scores)}: offer steps in order")
        self.scores[step] = value = float(self.score(step))
        if math.isnan(value):
            raise ValueError(f"the SFT checkpoint of step {step} scored NaN")
        if value >= self.threshold:
            self.picked = step
        return self.picked is not None

    def pick(self) -> Pick:
        """The first checkpoint that reached the threshold, else the last one offered, and why."""
        if not self.scores:
            raise ValueError("no SFT checkpoint to pick from: the SFT stage saved none")
        if self.picked is not None:
            value = self.scores[self.picked]
            why = (
                f"the first checkpoint whose greedy validation success {value:.2f} reaches "
                f"sft_pick={self.threshold:g}"
            )
            return Pick(self.picked, dict(self.scores), f"step {self.picked}: {why}")
        last, best = max(self.scores), max(self.scores, key=self.scores.__getitem__)
        why = (
            f"no checkpoint reached sft_pick={self.threshold:g} (best {self.scores[best]:.2f} at step {best})"
        )
        return Pick(last, dict(self.scores), f"step {last}, the last: {why}")


def pick_checkpoint(steps: Sequence[int], score: Callable[[int], float], threshold: float) -> Pick:
    """The first of ``steps`` (in increasing order) whose ``score(step)`` reaches ``threshold``, else the
    last; ``score`` is called once per step scored, and not after the pick."""
    picker = Picker(score, threshold)
    for step in sorted(set(steps)):
        if picker.offer(step):
            break
    return picker.pick()


class StopAtPick(SFTTrainer):
    """The SFT trainer, which offers each checkpoint to a :class:`Picker` once it is saved and ends the run
    after the step whose checkpoint is picked."""

    def __init__(self, cfg: SFTConfig, picker: Picker) -> None:
        super().__init__(cfg)
        self.picker = picker

    def save_checkpoint(self, step: int) -> None:
        super().save_checkpoint(step)
        if self.picker.offer(step):
            self.total_steps = step  # fit() trains while global_step < total_steps: this step is the last


def sft_until_picked(overrides: Sequence[str], picker: Picker) -> Pick:
    """``posttrain sft --config sft_tiny <overrides>`` (``checkpoint.async_save`` off: a checkpoint is scored
    once written), stopped at the first checkpoint ``picker`` picks; the pick."""
    cfg = load_config([*overrides, "checkpoint.async_save=false"], ["sft_tiny"], root=SFTConfig)
    preflight.check_sft(cfg)
    threads.configure()
    trainer = StopAtPick(cfg, picker)
    try:
        trainer.fit()
    finally:
        png = trainer.close()
        if png is not None:
            print(f"curves: {png}", file=sys.stderr)
    return picker.pick()


def hf_export(sft_dir: Path, step: int) -> Path:
    """The HF export of the SFT checkpoint of ``step``."""
    return sft_dir / f"global_step_{step}" / "actor" / "huggingface"


def greedy_success(model: Path, val_file: Path, grpo_args: Sequence[str]) -> float:
    """Mean reward of ``model``'s greedy episodes (``rollout.val_temperature``) on the questions of
    ``val_file``, through the GRPO trainer's validation path with the ``grpo_tiny`` preset and ``grpo_args``
    (the task's agent and rollout keys)."""
    from .config import load_config
    from .model_files import load_tokenizer
    from .rewards import RewardManager
    from .rl.dataset import PromptDataset
    from .rl.generation import RolloutSampler

    overrides = [f"model.path={model}", f"data.train_files=[{val_file}]", *grpo_args]
    cfg = load_config(overrides, ["grpo_tiny"])
    cfg.data.max_prompt_length = cfg.data.prompt_length(cfg.rollout.prompt_length)
    tokenizer = load_tokenizer(cfg.model)
    prompts = PromptDataset([str(val_file)], tokenizer, cfg.data, key="demo validation questions").items
    rollout = cfg.rollout.build(cfg.model, device="cpu")
    agent = cfg.agent.build(tokenizer, cfg.rollout)
    sampler = RolloutSampler(
        rollout,
        tokenizer,
        RewardManager(cfg.reward),
        cfg.rollout,
        trainer_seed=cfg.trainer.seed,
        dp_rank=0,
        replicas=None,
        weights=None,
        agent=agent,
    )
    try:
        _, scores, _, _ = sampler.sample_and_score(prompts, 0, validate=True)
    finally:
        if agent is not None:
            agent.close()
        rollout.release()
    return sum(scores) / len(scores)
