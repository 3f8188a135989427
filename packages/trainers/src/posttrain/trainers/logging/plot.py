"""A PNG of the training curves from ``metrics.jsonl``: one panel per metric family, drawn with Agg.

Panels: reward (training ``reward/mean`` and ``val/reward/mean``, RL runs only), losses (every ``*/loss`` key
in one panel), gradient norm, learning rate, throughput, and any other
``train/``, ``val/`` or ``critic/`` / ``actor/`` keys asked for. It uses ``matplotlib.figure.Figure`` with the
Agg canvas directly, so it never touches pyplot's global backend or needs a display.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DEFAULT_PANELS = (
    ("reward", ("reward/mean",)),
    ("loss", ("/loss",)),
    ("grad norm", ("grad_norm",)),
    ("learning rate", ("/lr",)),
    ("tokens/s", ("tokens_per_s",)),
)


def _series(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                out[k][0].append(row["step"])
                out[k][1].append(float(v))
    return dict(out)


def plot_metrics(
    metrics_path: str | Path,
    png_path: str | Path | None = None,
    panels: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_PANELS,
) -> Path | None:
    """Draw the curves of ``metrics_path`` into ``png_path`` (default: next to it); None if nothing to
    plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_path = Path(metrics_path)
    series = _series(metrics_path) if metrics_path.is_file() else {}
    chosen = [
        (title, [k for k in sorted(series) if any(k.endswith(s) for s in suffixes)])
        for title, suffixes in panels
    ]
    chosen = [(title, keys) for title, keys in chosen if keys]
    if not chosen:
        return None
    fig = Figure(figsize=(5 * len(chosen), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (title, keys) in zip(fig.subplots(1, len(chosen), squeeze=False)[0], chosen):
        for k in keys:
            steps, values = series[k]
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    out = Path(png_path) if png_path is not None else metrics_path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    return out
