"""The console backend: a tqdm progress bar over optimizer steps showing loss, tokens/s and the ETA.

tqdm computes the ETA from the rate of the steps done in this process (a resumed run starts the bar at the
resumed step). Validation results and other non-step metrics are printed above the bar with ``tqdm.write``.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

POSTFIX = {"train/loss": "loss", "val/loss": "val", "perf/tokens_per_s": "tok/s", "train/lr": "lr"}


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}" if abs(v) >= 1e7 else f"{v:.0f}"


class ConsoleLogger:
    """A progress bar of ``total`` steps starting at ``initial``."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train") -> None:
        self.bar = tqdm(
            total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr
        )
        self.last_step = initial

    def log(self, metrics: dict[str, Any], step: int) -> None:
        shown = {short: _fmt(float(metrics[k])) for k, short in POSTFIX.items() if k in metrics}
        if "val/loss" in metrics:
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
