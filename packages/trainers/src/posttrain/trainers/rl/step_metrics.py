"""Small helpers for a step's metrics: phase timers and reward-extra means."""

from __future__ import annotations

import time


def extra_means(extras: dict[str, list]) -> dict[str, float]:
    """``reward/extra/<key>/mean`` of every numeric value a reward function returned beside its score (a dict
    ``{"score": ..., "acc": ...}``); samples without the key, and non-numeric values, are left out. Computed
    on each data-parallel rank for its own samples and logged unreduced (ranks may see different keys)."""
    out = {}
    for key, values in extras.items():
        numbers = [float(v) for v in values if isinstance(v, (int, float))]
        if numbers:
            out[f"reward/extra/{key}/mean"] = sum(numbers) / len(numbers)
    return out


class Timer(dict):
    """``with timer("gen"): ...`` records seconds under ``timing_s/gen``."""

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer[f"timing_s/{name}"] = time.perf_counter() - self.start

        return _Span()
