"""GRPO step throughput through posttrain's own trainer (the code path of ``posttrain grpo``), per phase.

Each run builds the config with :func:`posttrain.trainers.config.load_config` from ``key=value`` overrides (as
``python -m posttrain.trainers.main_ppo`` does), constructs :class:`~posttrain.trainers.rl.trainer.RLTrainer`
and calls its ``train_step()`` for ``--warmup`` untimed and ``--steps`` timed steps (validation and
checkpoints, which ``fit()`` adds around the steps, are left out). Every run is its own subprocess (``python``
for the one-process launch, ``torchrun --nproc_per_node N`` for the other), so GPU memory is freed between
runs and a crash loses only that run.

Every run starts from the presets a user runs: ``--config grpo_gsm8k`` (with ``--config vllm_gpu`` stacked for
vLLM, as examples/grpo_fsdp.sh does), and overrides only what that script passes (model, data, batch sizes,
``rollout.n``, trainer paths) plus the work's lengths; what the presets leave null (activation recomputation,
the reference's offload, vLLM's ``max_num_seqs``) the run chooses and logs
(:mod:`posttrain.core.memory_policy`).
``--set key=value`` adds overrides (e.g. the pre-choice settings: ``model.enable_gradient_checkpointing=true
ref.engine.param_offload=true rollout.max_num_seqs=1024``).

Model: a random-init Qwen2 from ``posttrain model init`` (the ``0.5b`` and ``1.5b`` Qwen2.5 shapes, with a
151,936-token tokenizer), FSDP2 actor, bf16, KL loss to a reference (low_var_kl 0.001, as verl's GSM8K GRPO
example). Data: the script writes prompts of exactly ``--prompt-len`` tokens (digits, one token each, in the
chat template) with the ``synthetic_arithmetic`` rule reward. A random model seldom samples eos, so responses
run to ``--response-len``: the step does the full work (the table's ``clip`` column is the share that hit the
cap).
Works: ``bench`` (32 prompts x 8 responses per GPU, one optimizer step), ``readme`` (the README's GRPO
command:
128 prompts x 5 responses, mini-batches of 64 prompts), ``small`` (0.5B shape with a 448-token vocabulary,
32 x 8 x up to 256 tokens, ``--config grpo_tiny``; also named ``issue``), ``tiny`` (CPU).

Reported per run (after the warm-up): tokens/s/GPU = (prompt + response tokens over all ranks) / step time /
GPUs, as NeMo-RL counts; each ``timing_s/<phase>`` metric of the trainer (gen, old_log_prob, ref, adv,
update_actor, update_weights) in seconds and as a share of the step; peak memory over the steps (the ``torch``
allocator's and the device's used memory from NVML, which also sees vLLM's pool; the highest rank's). One JSON
line per run on stdout (and in ``--json``), then a table.

``--modes sync,one_step_off`` measures ``trainer.mode`` in the same launch: in one_step_off step k+1's batch
is generated while step k trains (``wait_rollout`` is the trainer waiting for it); the vLLM rollout then runs
its engine core in its own process on the same GPU (``rollout.executor=multiprocess``) with its own memory
budget (``rollout.gpu_memory_utilization`` of what the trainer left free), so generation and training share
the GPU at the same time.

``--placements colocated,process,disaggregated`` (modes other than sync) moves the rollout into a process of
its own per trainer rank (``trainer.rollout_placement=process``, vLLM in-process there): ``process`` on the
trainer's GPU (the push through host memory), ``disaggregated`` on a GPU of its own (``--gpus`` trainer ranks
and as many rollout GPUs, the push over NCCL); tokens/s/GPU then counts every GPU the run holds.

This file is the command line; ``rl_runs.py`` holds the work, model, data and overrides of one run,
``rl_worker.py`` the subprocess that runs it and its launcher, ``rl_report.py`` the rows and the table.

Every step's generation seconds, tokens and Python GC seconds are reported too (``gen_s_each``, warm-up
first), and ``gen_drift`` (the last step's generation seconds per token over the first's, minus one);
``--check-drift`` exits 1 when it passes 10%.

    uv run python bench/rl_throughput.py --tiny     # CPU, tiny model, both launches
                                                    # (minutes: ~9 s a step on 2 busy cores)
    python3 bench/rl_throughput.py --shapes 0.5b --rollouts hf,vllm --json rl.json          # one GPU
    python3 bench/rl_throughput.py --work small,bench --rollouts vllm --launchers torchrun --gpus 2
    python3 bench/rl_throughput.py --work readme --rollouts vllm --launchers torchrun --steps 3 --check-drift
    python3 bench/rl_throughput.py --shapes 0.5b --rollouts vllm --launchers process --modes sync,one_step_off
    uv run python bench/rl_throughput.py --tiny --launchers process --modes sync,one_step_off  # CPU, a minute
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# trl_grpo.py uses the shared model, data, launcher and report as rl.*
from rl_report import PHASES, drift_failures, emit, mean, summarize, table  # noqa: F401
from rl_runs import DRIFT, WORKS, Work, overrides, prepare_data, prepare_model, presets  # noqa: F401
from rl_worker import MemoryPeak, launch, worker  # noqa: F401

MODES = ("sync", "one_step_off")
LAUNCHERS = ("process", "torchrun")
ROLLOUTS = ("hf", "vllm")
PLACEMENTS = ("colocated", "process", "disaggregated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, short sequences, fp32, CPU when no GPU")
    p.add_argument(
        "--work",
        default=None,
        help="comma list of bench, readme, small, tiny (default bench; tiny with --tiny)",
    )
    p.add_argument("--shapes", default=None, help="comma list of model sizes for --work bench (default 0.5b)")
    p.add_argument(
        "--rollouts", default=None, help="comma list of hf, vllm (default hf,vllm; hf with --tiny)"
    )
    p.add_argument("--launchers", default="process,torchrun", help="comma list of process, torchrun")
    p.add_argument(
        "--modes",
        default="sync",
        help="comma list of trainer.mode: sync, one_step_off (vLLM then runs its engine in its own process "
        "on the same GPU, rollout.executor=multiprocess, and generates while the trainer trains)",
    )
    p.add_argument(
        "--placements",
        default="colocated",
        help="comma list of colocated, process (the rollout in a process of its own on the trainer's GPU), "
        "disaggregated (on a GPU of its own: twice the GPUs); the last two only with modes other than sync",
    )
    p.add_argument("--gpus", type=int, default=1, help="torchrun processes (the process launch uses one)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step and GPU (default: the work's)")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (default: the work's)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: the work's)")
    p.add_argument("--response-len", type=int, default=None, help="response cap (default: the work's)")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="max_token_len_per_gpu (default 16384)")
    p.add_argument("--no-kl", action="store_true", help="no KL loss, so no reference model")
    p.add_argument(
        "--check-drift",
        action="store_true",
        help=f"exit 1 when a run's last step generates more than {DRIFT:.0%} slower per token than its first",
    )
    p.add_argument("--set", action="append", default=[], help="extra key=value override (repeatable)")
    p.add_argument("--workdir", default=None, help="models, data and run dirs (default /tmp/rl_bench)")
    p.add_argument("--json", default=None, help="append one JSON line per run to this file")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a run is killed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a run's spec file (internal)
    return p.parse_args(argv)


def csv(value: str | None, default: str) -> list[str]:
    return [v for v in (value or default).split(",") if v]


def commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def plan(args: argparse.Namespace) -> list[tuple[str, Work]]:
    """(work name, work with the command line's sizes) for every run's work, one per shape."""
    out = []
    for name in csv(args.work, "tiny" if args.tiny else "bench"):
        if name not in WORKS:
            raise ValueError(f"--work {name!r} is unknown: use {', '.join(WORKS)}")
        base = WORKS[name]
        sizes = {
            "prompts": args.prompts,
            "n": args.n,
            "prompt_len": args.prompt_len,
            "response_len": args.response_len,
            "tokens_per_gpu": args.tokens_per_gpu,
        }
        base = replace(base, **{k: v for k, v in sizes.items() if v is not None})
        for shape in [base.shape] if base.shape else csv(args.shapes, "0.5b"):
            out.append((name, replace(base, shape=shape)))
    return out


def choices(args: argparse.Namespace) -> tuple[list[str], list[str], list[str], list[str]]:
    """The launchers, rollouts, modes and placements of the command line; a ValueError naming unknown ones."""
    launchers = csv(args.launchers, "process,torchrun")
    rollouts = csv(args.rollouts, "hf" if args.tiny else "hf,vllm")
    modes = csv(args.modes, "sync")
    placements = csv(args.placements, "colocated")
    bad = [x for x in launchers if x not in LAUNCHERS] + [x for x in rollouts if x not in ROLLOUTS]
    bad += [x for x in modes if x not in MODES]
    bad += [x for x in placements if x not in PLACEMENTS]
    if bad:
        raise ValueError(
            f"unknown launcher/rollout/mode {bad}: launchers are process, torchrun; rollouts hf, vllm; "
            f"modes {', '.join(MODES)}; placements colocated, process, disaggregated"
        )
    return launchers, rollouts, modes, placements


def run(
    args: argparse.Namespace, name: str, work: Work, paths: tuple[Path, Path, Path], how: tuple[str, ...]
) -> dict[str, Any]:
    """One run's row: ``paths`` are (workdir, model, data), ``how`` (rollout, launcher, mode, placement)."""
    workdir, model, data = paths
    rollout, launcher, mode, placement = how
    world = args.gpus if launcher == "torchrun" else 1
    gpus = 2 * world if placement == "disaggregated" else world
    label = {
        "work": name,
        "shape": work.shape,
        "rollout": rollout,
        "launcher": launcher,
        "mode": mode,
        "placement": placement,
        "gpus": gpus,
    }
    run_dir = workdir / "runs" / "-".join(str(v) for v in label.values())
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "overrides": overrides(work, args, model, data, rollout, world, run_dir, mode, placement),
        "presets": presets(work, rollout),
        "warmup": args.warmup,
        "steps": args.steps,
    }
    print(f"[rl-bench] {label} ...", file=sys.stderr, flush=True)
    got = launch(spec, launcher, world, run_dir, args.timeout, script=__file__)
    row = {"bench": "rl_throughput", "commit": args.commit, **label, **asdict(work)}
    row.update({"warmup": args.warmup, "steps": args.steps, "prompts": work.prompts * world})
    row.update(summarize(got, gpus) if isinstance(got, list) else {"error": got})
    row["overrides"] = spec["overrides"]
    return row


def report(rows: list[dict], check_drift: bool) -> int:
    """Print the table and each run's generation seconds per step; 1 when a run failed or drifted."""
    print("\n" + table(rows))
    for r in rows:
        if "gen_s_each" in r:
            print(
                f"[rl-bench] {r['work']} {r['rollout']} {r['launcher']} {r['mode']}: gen s per step "
                f"{r['gen_s_each']} (warm-up first), drift {r.get('gen_drift')}, gc s {r.get('gc_s_each')}"
            )
    drifted = drift_failures(rows, DRIFT) if check_drift else []
    for line in drifted:
        print(f"[rl-bench] DRIFT: {line}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) and not drifted else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    workdir = Path(args.workdir or "/tmp/rl_bench")
    launchers, rollouts, modes, placements = choices(args)
    rows, args.commit = [], commit()
    for name, work in plan(args):
        model = prepare_model(workdir, work.shape, work.vocab)
        data = prepare_data(workdir, model, work, work.prompts * args.gpus * (args.warmup + args.steps + 1))
        runs = [(r, la, m, p) for r in rollouts for la in launchers for m in modes for p in placements]
        for how in runs:
            if how[3] != "colocated" and how[2] == "sync":
                continue  # a rollout process only generates beside training
            rows.append(run(args, name, work, (workdir, model, data), how))
            emit(rows[-1], args.json)
    return report(rows, args.check_drift)


if __name__ == "__main__":
    raise SystemExit(main())
