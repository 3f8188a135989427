"""The report half of ``bench/rl_throughput.py`` (and ``bench/trl_grpo.py``): a run's per-step results summed up
into one row (step time, tokens/s/GPU, each phase's seconds and share, peaks), the fixed-width table of the
rows, and the JSON lines."""

from __future__ import annotations

import json
import sys
from typing import Any

PHASES = ("gen", "wait_rollout", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def summarize(results: list[dict], world: int) -> dict[str, Any]:
    """Step time, tokens/s/GPU, each phase's seconds and share, response lengths and peaks of one run."""
    steps = results[0]["steps"]
    step_s = mean([s["wall_s"] for s in steps])
    tokens = mean([s["perf/tokens"] for s in steps])
    row: dict[str, Any] = {
        "step_s": round(step_s, 3),
        "tokens_per_step": round(tokens),
        "tokens_per_s_per_gpu": round(tokens / step_s / world, 1),
        "response_len_mean": round(mean([s["response_length/mean"] for s in steps]), 1),
        "clip_ratio": round(mean([s["response_length/clip_ratio"] for s in steps]), 3),
        "init_s": round(results[0]["init_s"], 1),
    }
    phases = sorted(
        {k[len("timing_s/") :] for s in steps for k in s if k.startswith("timing_s/")}, key=phase_order
    )
    for name in phases:
        sec = mean([s.get(f"timing_s/{name}", 0.0) for s in steps])
        row[f"{name}_s"], row[f"{name}_share"] = round(sec, 3), round(sec / step_s, 3)
    # With the rollout ahead (a wait_rollout phase), the push runs on the rollout's thread, beside the step.
    inside = [p for p in phases if not ("wait_rollout" in phases and p == "update_weights")]
    row["other_s"] = round(step_s - sum(row[f"{p}_s"] for p in inside), 3)
    for key in ("peak_torch_gib", "peak_device_gib"):
        seen = [r[key] for r in results if r[key] is not None]
        row[key] = max(seen) if seen else None
    return row


def phase_order(name: str) -> tuple[int, str]:
    return (PHASES.index(name) if name in PHASES else len(PHASES), name)


def table(rows: list[dict[str, Any]]) -> str:
    """The runs as a fixed-width table."""
    head = ["work", "shape", "rollout", "launch", "mode", "gpus", "step s", "tok/s/GPU"]
    head += [f"{p} s (%)" for p in PHASES] + ["resp", "clip", "peak GiB"]
    lines = [" | ".join(head)]
    for r in rows:
        mode = r.get("mode", "sync") + (
            "" if r.get("placement", "colocated") == "colocated" else f" ({r['placement']})"
        )
        cells = [r["work"], r["shape"], r["rollout"], r["launcher"], mode, str(r["gpus"])]
        if "error" in r:
            lines.append(" | ".join(cells + ["failed: " + r["error"].splitlines()[0]]))
            continue
        cells += [f"{r['step_s']:.2f}", f"{r['tokens_per_s_per_gpu']:.0f}"]
        cells += [
            f"{r[f'{p}_s']:.2f} ({100 * r[f'{p}_share']:.0f})" if f"{p}_s" in r else "-" for p in PHASES
        ]
        peak = r["peak_device_gib"] if r["peak_device_gib"] is not None else r["peak_torch_gib"]
        cells += [
            f"{r['response_len_mean']:.0f}",
            f"{r['clip_ratio']:.2f}",
            "-" if peak is None else f"{peak:.1f}",
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def emit(row: dict[str, Any], path: str | None) -> None:
    """Print one run's JSON line (and append it to ``path``); a failed run's log tail goes to stderr."""
    line = json.dumps(row)
    print(line, flush=True)
    if "error" in row:
        print(f"[rl-bench] run failed: {row['error']}", file=sys.stderr, flush=True)
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")
