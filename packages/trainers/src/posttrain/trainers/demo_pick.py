"""Which SFT checkpoint ``posttrain demo`` starts GRPO from (``sft_pick``).

GRPO learns from the reward differences within a group of episodes of one prompt. An SFT model that rarely
succeeds gives groups without a success (no advantage, nothing to learn); one trained until it succeeds on
nearly every training question gives groups without a failure, and a policy so sharp that the episodes of a
group barely differ. The demo therefore saves the SFT model every :data:`SAVE_EVERY` steps, scores the
checkpoints in order by their greedy success on validation questions (neither trained on nor in the held-out
test set), and starts GRPO from the first whose success reaches ``sft_pick``; when none does, from the last.
Scoring runs the GRPO trainer's own validation path (:class:`~posttrain.trainers.rl.generation.RolloutSampler`
with the same config tree), so a checkpoint's score is what GRPO's step-0 validation would report on those
questions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.core.config.loader import ConfigError

SAVE_EVERY = 50
"""SFT steps between the checkpoints the picker scores (the last step is always saved too)."""


def check_sft_pick(value: float) -> float:
    """``value`` as a float, or a :class:`ConfigError` (a ValueError) naming the fix when it is not a success
    rate in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise ConfigError(
            f"sft_pick={value!r} is not a success rate in (0, 1]: set e.g. sft_pick=0.5 (GRPO starts from the "
            "first SFT checkpoint whose greedy validation success reaches it), or sft_pick=1 to start from the "
            "last SFT step unless a checkpoint is perfect"
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


def pick_checkpoint(steps: Sequence[int], score: Callable[[int], float], threshold: float) -> Pick:
    """The first of ``steps`` (in increasing order) whose ``score(step)`` reaches ``threshold``, else the last;
    ``score`` is called once per step scored, and not after the pick."""
    threshold = check_sft_pick(threshold)
    if not steps:
        raise ValueError("no SFT checkpoint to pick from: the SFT stage saved none")
    scores: dict[int, float] = {}
    for step in sorted(set(steps)):
        scores[step] = value = float(score(step))
        if math.isnan(value):
            raise ValueError(f"the SFT checkpoint of step {step} scored NaN")
        if value >= threshold:
            why = f"the first checkpoint whose greedy validation success {value:.2f} reaches sft_pick={threshold:g}"
            return Pick(step, scores, f"step {step}: {why}")
    last = max(scores)
    best = max(scores, key=scores.__getitem__)
    why = (
        f"no checkpoint reached sft_pick={threshold:g} (best {scores[best]:.2f} at step {best}), so the last "
        "step"
    )
    return Pick(last, scores, f"step {last}: {why}")


def checkpoint_steps(sft_dir: Path) -> list[int]:
    """The steps of the SFT checkpoints under ``sft_dir`` that carry an HF export, in order."""
    found = []
    for path in sft_dir.glob("global_step_*"):
        step = path.name.removeprefix("global_step_")
        if step.isdigit() and (path / "actor" / "huggingface").is_dir():
            found.append(int(step))
    return sorted(found)


def hf_export(sft_dir: Path, step: int) -> Path:
    """The HF export of the SFT checkpoint of ``step``."""
    return sft_dir / f"global_step_{step}" / "actor" / "huggingface"


def greedy_success(model: Path, val_file: Path, grpo_args: Sequence[str]) -> float:
    """Mean reward of ``model``'s greedy episodes (``rollout.val_temperature``) on the questions of ``val_file``,
    through the GRPO trainer's validation path with the ``grpo_tiny`` preset and ``grpo_args`` (the task's
    agent and rollout keys)."""
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
