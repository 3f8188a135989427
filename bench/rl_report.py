"""The report half of ``bench/rl_throughput.py`` (and ``bench/trl_grpo.py``): a run's per-step results summed
up into one row (step time, tokens/s/GPU, each phase's seconds and share, peaks), the fixed-width table of the
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
    every = results[0]["steps"]
    steps = [s for s in every if not s.get("warmup")]
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
    row.update(per_step(every))
    return row


def per_step(steps: list[dict]) -> dict[str, Any]:
    """Every step's wall time, generation time, tokens and GC time (the warm-up first), and ``gen_drift``: the
    last step's generation seconds per token over the first's, minus one (0.10 = the last is 10% slower)."""
    out: dict[str, Any] = {
        "steps_s": [round(s["wall_s"], 2) for s in steps],
        "tokens_each": [round(s["perf/tokens"]) for s in steps],
    }
    for key, name in (("timing_s/gen", "gen_s_each"), ("gc_s", "gc_s_each"), ("gc_full", "gc_full_each")):
        if all(key in s for s in steps):
            out[name] = [round(s[key], 2) for s in steps]
    gens = out.get("gen_s_each")
    if gens and len(gens) > 1 and gens[0] > 0:
        first, last = gens[0] / out["tokens_each"][0], gens[-1] / out["tokens_each"][-1]
        out["gen_drift"] = round(last / first - 1, 3)
    return out


def drift_failures(rows: list[dict[str, Any]], limit: float) -> list[str]:
    """One line per run whose last step generated more than ``limit`` slower per token than its first."""
    return [
        f"{r['work']} {r['shape']} {r['rollout']} {r['launcher']} {r.get('mode', 'sync')}: generation "
        f"{r['gen_s_each']} s over the steps, the last {100 * r['gen_drift']:.0f}% slower per token than the "
        f"first (limit {100 * limit:.0f}%)"
        for r in rows
        if r.get("gen_drift") is not None and r["gen_drift"] > limit
    ]


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


def metrics_report(path: str, gpus: int = 1) -> str:
    """Every step of a run's ``metrics.jsonl`` (what ``trainer.logger=[...,file]`` writes, e.g. from
    examples/grpo_fsdp.sh): step time, tokens/s/GPU, generation seconds (in the modes that generate beside the
    step, the seconds the step waited for its rollouts instead), actor-update seconds, and, where the step
    generates, the generation drift per token from the first step to the last (flagged for agent runs, whose
    turns and tool waits differ from step to step)."""
    rows = [json.loads(x) for x in open(path) if x.strip()]
    rows = [r for r in rows if "perf/step_s" in r]
    gen = "timing_s/gen" if all("timing_s/gen" in r for r in rows) else "timing_s/wait_rollout"
    lines = [
        f"step | step s | tok/s/GPU | {'gen' if gen == 'timing_s/gen' else 'wait_rollout'} s | update_actor "
        "s | tokens"
    ]
    for r in rows:
        lines.append(
            f"{r.get('step', '?')} | {r['perf/step_s']:.2f} | "
            f"{r['perf/tokens'] / r['perf/step_s'] / gpus:.0f} | {r.get(gen, 0.0):.2f} | "
            f"{r.get('timing_s/update_actor', 0.0):.2f} | {r['perf/tokens']:.0f}"
        )
    if len(rows) > 1:
        timed = rows[1:]
        tps = mean([r["perf/tokens"] for r in timed]) / mean([r["perf/step_s"] for r in timed]) / gpus
        drift = ""
        if gen == "timing_s/gen":
            first = rows[0][gen] / rows[0]["perf/tokens"]
            last = rows[-1][gen] / rows[-1]["perf/tokens"]
            drift = f"gen drift per token, first to last: {100 * (last / first - 1):+.1f}%"
            if "reward/extra/agent/turns/mean" in rows[0]:  # turns, tools and lengths differ step to step
                drift += " (agent episodes: each step's work differs, so this is not a same-work comparison)"
            drift += "; "
        line = f"{drift}steps 2..{len(rows)}: {tps:.0f} tok/s/GPU"
        # the later half: past what a mode that generates ahead banked during the first steps
        if len(rows) >= 6:
            half = rows[len(rows) // 2 :]
            late = mean([r["perf/tokens"] for r in half]) / mean([r["perf/step_s"] for r in half]) / gpus
            line += f"; steps {len(rows) - len(half) + 1}..{len(rows)}: {late:.0f}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":  # python3 bench/rl_report.py RUN_DIR/metrics.jsonl [GPUS]
    print(metrics_report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
