"""Compare a run resumed from a checkpoint with the uninterrupted run it was cut from: every logged number but
the timings (``perf/``, ``timing_s/``) and memory readings (``*_gib``: what vLLM's sleep freed depends on what
the process allocated before, which a resumed process did not) on the steps the resumed run logged, and the HF
exports (``hf_model`` in ``checkpoint.save_contents``) of its last checkpoint. Prints the largest relative
difference of each metric that differs and the largest absolute weight difference; exits 1 when a metric is
off by more than ``--rtol``, a weight by more than ``--atol`` or a step, metric or tensor is missing (the
defaults, 0 and 0, ask for bits).

    python3 bench/resume_check.py REF_RUN RESUMED_RUN [--rtol 1e-3] [--atol 1e-3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def metrics(run: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = ("perf/", "timing_s/")

    def compared(key: str, value: object) -> bool:
        return isinstance(value, (int, float)) and not key.startswith(timed) and not key.endswith("_gib")

    return {r["step"]: {k: v for k, v in r.items() if compared(k, v)} for r in rows}


def export(run: Path) -> tuple[int, dict[str, torch.Tensor]]:
    steps = sorted(int(p.parents[1].name.split("_")[-1]) for p in run.glob("global_step_*/actor/huggingface"))
    if not steps:
        raise SystemExit(f"{run}: no global_step_*/actor/huggingface (save with hf_model in save_contents)")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((run / f"global_step_{steps[-1]}/actor/huggingface").glob("*.safetensors")):
        tensors.update(load_file(f))
    return steps[-1], tensors


def compare_metrics(ref: dict, new: dict, rtol: float) -> list[str]:
    bad = [f"step {s}: not in the reference" for s in new if s not in ref]
    for step in sorted(set(new) & set(ref)):
        for key, want in ref[step].items():
            got = new[step].get(key)
            if got is None:
                bad.append(f"step {step} {key}: missing")
                continue
            rel = abs(got - want) / max(abs(want), 1e-12)
            if rel:
                print(f"step {step} {key}: {want!r} -> {got!r} (rel {rel:.2e})")
            if rel > rtol:
                bad.append(f"step {step} {key}: rel {rel:.2e} > {rtol}")
    return bad


def compare_weights(ref: Path, new: Path, atol: float) -> list[str]:
    (a_step, a), (b_step, b) = export(ref), export(new)
    if a_step != b_step or a.keys() != b.keys():
        return [f"exports differ in step ({a_step}, {b_step}) or names ({sorted(a.keys() ^ b.keys())[:5]})"]
    worst = max((float((a[k].double() - b[k].double()).abs().max()), k) for k in a)
    print(f"step {a_step} export: {len(a)} tensors, max |diff| {worst[0]:.3e} ({worst[1]})")
    return [f"weights: max |diff| {worst[0]:.3e} > {atol}"] if worst[0] > atol else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", type=Path)
    p.add_argument("resumed", type=Path)
    p.add_argument("--rtol", type=float, default=0.0, help="largest relative metric difference (0: equal)")
    p.add_argument("--atol", type=float, default=0.0, help="largest absolute weight difference (0: equal)")
    args = p.parse_args(argv)
    new = metrics(args.resumed)
    bad = compare_metrics(metrics(args.reference), new, args.rtol)
    bad += compare_weights(args.reference, args.resumed, args.atol)
    print(
        f"resume check over steps {min(new)}-{max(new)}: " + ("; ".join(bad) if bad else "within tolerance")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
