"""The console backend: a tqdm progress bar over optimizer steps with the numbers a run is judged by.

The bar's postfix shows, when the step logged them: RL: the mean reward and its change from the previous step
(``reward=0.41(+0.03)``), policy loss, KL (the KL loss, else the PPO KL), entropy, mean response length, the
clip fraction, the critic's value loss; SFT: loss and token accuracy; both: the last validation score
(``val/reward/mean`` or ``val/loss``, kept until the next validation), the skipped optimizer steps so far
(only once there is one), tokens/s and the learning rate. tqdm computes the ETA from the rate of the steps
done in this process (a resumed run starts the bar at the resumed step). Validation results are also printed
above the bar with ``tqdm.write``.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

SHOWN = (
    ("reward", ("reward/mean",)),
    ("loss", ("train/loss",)),
    ("acc", ("train/token_acc",)),
    ("pg_loss", ("actor/pg_loss",)),
    ("kl", ("actor/kl_loss", "actor/ppo_kl")),
    ("entropy", ("actor/entropy",)),
    ("resp_len", ("response_length/mean",)),
    ("clipfrac", ("actor/pg_clipfrac",)),
    ("vf_loss", ("critic/vf_loss",)),
    ("tok/s", ("perf/tokens_per_s",)),
    ("lr", ("train/lr",)),
)
"""(label, metric keys tried in order) of the postfix; the validation score and skipped steps are added."""
VAL_KEYS = ("val/reward/mean", "val/loss")
SKIPPED_KEYS = ("actor/skipped_step", "critic/skipped_step", "train/skipped_step")


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}" if abs(v) >= 1e7 else f"{v:.0f}"


class ConsoleLogger:
    """A progress bar of ``total`` steps starting at ``initial``."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train") -> None:
        self.bar = tqdm(
            total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr
        )
        self.last_step = initial
        self.last_reward: float | None = None
        self.val: tuple[str, float] | None = None
        self.skipped = 0

    def postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        """The postfix of one step's ``metrics`` (updates the kept reward, validation score and skip
        count)."""
        shown: dict[str, str] = {}
        for label, keys in SHOWN:
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                shown[label] = _fmt(float(metrics[key]))
        if "reward/mean" in metrics:
            reward = float(metrics["reward/mean"])
            if self.last_reward is not None:
                shown["reward"] += f"({reward - self.last_reward:+.3g})"
            self.last_reward = reward
        val_key = next((k for k in VAL_KEYS if k in metrics), None)
        if val_key is not None:
            self.val = (val_key, float(metrics[val_key]))
        if self.val is not None:
            shown["val"] = _fmt(self.val[1])
        self.skipped += int(max((float(metrics.get(k, 0.0)) for k in SKIPPED_KEYS), default=0.0) > 0)
        if self.skipped:
            shown["skipped"] = str(self.skipped)
        return shown

    def log(self, metrics: dict[str, Any], step: int) -> None:
        shown = self.postfix(metrics)
        if any(k.startswith("val/") for k in metrics):
            self.bar.write(
                f"step {step}: "
                + ", ".join(
                    f"{k}={_fmt(float(v))}" for k, v in sorted(metrics.items()) if k.startswith("val/")
                ),
                file=sys.stderr,
            )
        if step > self.last_step:
            self.bar.update(step - self.last_step)
            self.last_step = step
        if shown:
            self.bar.set_postfix(shown, refresh=True)

    def close(self) -> None:
        self.bar.close()
