"""GRPO step throughput through posttrain's own trainer (the code path of ``posttrain grpo``), per phase.

Each run builds the config with :func:`posttrain.trainers.config.load_config` from ``key=value`` overrides (as
``python -m posttrain.trainers.main_ppo`` does), constructs :class:`~posttrain.trainers.rl.trainer.RLTrainer`
and calls its ``train_step()`` for ``--warmup`` untimed and ``--steps`` timed steps (validation and checkpoints,
which ``fit()`` adds around the steps, are left out). Every run is its own subprocess (``python`` for the
one-process launch, ``torchrun --nproc_per_node N`` for the other), so GPU memory is freed between runs and a
crash loses only that run.

Every run starts from the presets a user runs: ``--config grpo_gsm8k`` (with ``--config vllm_gpu`` stacked for
vLLM, as examples/grpo_fsdp.sh does), and overrides only what that script passes (model, data, batch sizes,
``rollout.n``, trainer paths) plus the work's lengths; what the presets leave null (activation recomputation, the
reference's offload, vLLM's ``max_num_seqs``) the run chooses and logs (:mod:`posttrain.core.memory_policy`).
``--set key=value`` adds overrides (e.g. the pre-choice settings: ``model.enable_gradient_checkpointing=true
ref.engine.param_offload=true rollout.max_num_seqs=1024``).

Model: a random-init Qwen2 from ``posttrain model init`` (the ``0.5b`` and ``1.5b`` Qwen2.5 shapes, with a
151,936-token tokenizer), FSDP2 actor, bf16, KL loss to a reference (low_var_kl 0.001, as verl's GSM8K GRPO
example). Data: the script writes prompts of exactly ``--prompt-len`` tokens (digits, one token each, in the chat
template) with the ``synthetic_arithmetic`` rule reward. A random model seldom samples eos, so responses run to
``--response-len``: the step does the full work (the table's ``clip`` column is the share that hit the cap).
Works: ``bench`` (32 prompts x 8 responses per GPU, one optimizer step), ``readme`` (the README's GRPO command:
128 prompts x 5 responses, mini-batches of 64 prompts), ``small`` (0.5B shape with a 448-token vocabulary,
32 x 8 x up to 256 tokens, ``--config grpo_tiny``; also named ``issue``), ``tiny`` (CPU).

Reported per run (after the warm-up): tokens/s/GPU = (prompt + response tokens over all ranks) / step time /
GPUs, as NeMo-RL counts; each ``timing_s/<phase>`` metric of the trainer (gen, old_log_prob, ref, adv,
update_actor, update_weights) in seconds and as a share of the step; peak memory over the steps (the ``torch``
allocator's and the device's used memory from NVML, which also sees vLLM's pool; the highest rank's). One JSON line per run on stdout (and in
``--json``), then a table.

``--modes sync,one_step_off`` measures ``trainer.mode`` in the same launch: in one_step_off step k+1's batch is
generated while step k trains (``wait_rollout`` is the trainer waiting for it); the vLLM rollout then runs its
engine core in its own process on the same GPU (``rollout.executor=multiprocess``) with its own memory budget
(``rollout.gpu_memory_utilization`` of what the trainer left free), so generation and training share the GPU
at the same time.

``--placements colocated,process,disaggregated`` (modes other than sync) moves the rollout into a process of
its own per trainer rank (``trainer.rollout_placement=process``, vLLM in-process there): ``process`` on the
trainer's GPU (the push through host memory), ``disaggregated`` on a GPU of its own (``--gpus`` trainer ranks and
as many rollout GPUs, the push over NCCL); tokens/s/GPU then counts every GPU the run holds.

Every step's generation seconds, tokens and Python GC seconds are reported too (``gen_s_each``, warm-up first),
and ``gen_drift`` (the last step's generation seconds per token over the first's, minus one); ``--check-drift``
exits 1 when it passes 10%.

    uv run python bench/rl_throughput.py --tiny     # CPU, tiny model, both launches (minutes: ~9 s a step on 2 busy cores)
    python3 bench/rl_throughput.py --shapes 0.5b --rollouts hf,vllm --json rl.json          # one GPU
    python3 bench/rl_throughput.py --work small,bench --rollouts vllm --launchers torchrun --gpus 2
    python3 bench/rl_throughput.py --work readme --rollouts vllm --launchers torchrun --steps 3 --check-drift
    python3 bench/rl_throughput.py --shapes 0.5b --rollouts vllm --launchers process --modes sync,one_step_off
    uv run python bench/rl_throughput.py --tiny --launchers process --modes sync,one_step_off   # CPU, a minute
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rl_report import PHASES, drift_failures, emit, mean, summarize, table  # noqa: F401  (trl_grpo.py uses them as rl.*)

MODES = ("sync", "one_step_off")


@dataclass(frozen=True)
class Work:
    """What one step does."""

    shape: str | None
    """``posttrain model init`` size; None takes ``--shapes``."""
    prompts: int
    """Prompts per step and GPU (each with ``n`` responses)."""
    n: int
    """Responses per prompt."""
    prompt_len: int
    """Tokens per prompt, chat template included."""
    response_len: int
    """Response cap in tokens."""
    vocab: int | None = None
    """Tokenizer size (None: the shape's own)."""
    tokens_per_gpu: int | None = None
    """``max_token_len_per_gpu`` of actor and reference (None: the preset's)."""
    preset: str = "grpo_gsm8k"
    """The ``--config`` task preset the run starts from (``vllm_gpu`` is stacked on ``grpo_gsm8k`` for vLLM, as
    examples/grpo_fsdp.sh does)."""
    mini_prompts: int | None = None
    """``actor.ppo_mini_batch_size`` per GPU (None: all the step's prompts, one optimizer step)."""
    bf16: bool = True
    """bf16 engines and rollout (the preset's); fp32 otherwise."""


WORKS = {
    "bench": Work(shape=None, prompts=32, n=8, prompt_len=256, response_len=1024),
    # the README's GRPO command: examples/grpo_fsdp.sh with data.train_batch_size=128 actor.ppo_mini_batch_size=64
    "readme": Work(shape=None, prompts=128, n=5, prompt_len=256, response_len=1024, mini_prompts=64),
    "small": Work(
        shape="0.5b",
        prompts=32,
        n=8,
        prompt_len=32,
        response_len=256,
        vocab=448,
        preset="grpo_tiny",
        tokens_per_gpu=16384,
    ),
    "tiny": Work(
        shape="tiny", prompts=4, n=4, prompt_len=24, response_len=16, tokens_per_gpu=4096, bf16=False
    ),
}
WORKS["issue"] = WORKS["small"]  # the name BENCHMARKS.md's older records ran it under
DRIFT = 0.10
"""The most a later step's generation may be slower than the first's, per generated token."""


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


# ---------------------------------------------------------------------------------------------- model and data
def prepare_model(workdir: Path, shape: str, vocab: int | None) -> Path:
    """A random-init model of ``shape`` (made once per workdir; the tokenizer is written last)."""
    from posttrain.trainers.model_init import count_parameters, init_model

    out = workdir / "models" / f"{shape}-v{vocab or 'default'}"
    if not (out / "tokenizer.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        init_model(out, size=shape, vocab_size=vocab)
        print(
            f"[rl-bench] model {shape}: {count_parameters(out):,} parameters in "
            f"{time.perf_counter() - start:.0f}s -> {out}",
            file=sys.stderr,
        )
    return out


def digit_prompts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` user messages of random digits that render to exactly ``length`` tokens in the chat template."""
    overhead = len(chat_ids(tokenizer, ""))
    if length <= overhead:
        raise ValueError(f"--prompt-len {length} must exceed the chat template's {overhead} tokens")
    rng = random.Random(seed)
    texts = ["".join(rng.choice("0123456789") for _ in range(length - overhead)) for _ in range(count)]
    got = {len(chat_ids(tokenizer, t)) for t in texts[:4]}
    if got != {length}:
        raise ValueError(
            f"digit prompts render to {sorted(got)} tokens, not {length}: digits must be 1 token each"
        )
    return texts


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prepare_data(workdir: Path, model_dir: Path, work: Work, rows: int) -> Path:
    """A parquet of ``rows`` prompts in verl's columns (data_source synthetic_arithmetic: the ``####`` rule)."""
    from transformers import AutoTokenizer

    from posttrain.trainers.data.convert import write_parquet
    from posttrain.trainers.data.synthetic import make_row

    path = workdir / "data" / f"{model_dir.name}-p{work.prompt_len}-r{rows}.parquet"
    if not path.is_file():
        tok = AutoTokenizer.from_pretrained(model_dir)
        texts = digit_prompts(tok, rows, work.prompt_len)
        kwargs = dict(data_source="synthetic_arithmetic", ability="math", instruction="", split="train")
        write_parquet([make_row(t, "#### 7", "7", index=i, **kwargs) for i, t in enumerate(texts)], path)
    return path


# ---------------------------------------------------------------------------------------------- one run
def overrides(
    work: Work,
    args: argparse.Namespace,
    model: Path,
    data: Path,
    rollout: str,
    world: int,
    run_dir: Path,
    mode: str = "sync",
    placement: str = "colocated",
):
    """The ``key=value`` list of one run: what examples/grpo_fsdp.sh passes on top of its presets (model, data,
    batch, rollout, trainer) and the work's sizes; every other setting is the preset's."""
    prompts = work.prompts * world
    out = [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        "data.prompt_key=prompt",
        f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={(work.mini_prompts or work.prompts) * world}",
        "algorithm.adv_estimator=grpo",
        f"rollout.name={rollout}",
        f"rollout.n={work.n}",
        f"rollout.response_length={work.response_len}",
        f"trainer.total_training_steps={args.warmup + args.steps}",
        f"trainer.n_gpus_per_node={world}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
    ]
    if work.prompt_len > 512 or work.preset != "grpo_gsm8k":
        out += [f"rollout.prompt_length={work.prompt_len}"]
    if work.tokens_per_gpu is not None:
        out += [f"{r}.engine.max_token_len_per_gpu={work.tokens_per_gpu}" for r in ("actor", "ref")]
    if not work.bf16:  # CPU smoke run: fp32, and compiling the log-prob chunk costs more than it saves
        out += ["rollout.dtype=float32"]
        for role in ("actor", "ref"):
            out += [f"{role}.engine.dtype=float32", f"{role}.engine.use_torch_compile=false"]
    if args.no_kl:
        out += ["actor.use_kl_loss=false"]
    if mode != "sync":
        # one batch past the timed steps, so the last timed step also trains while the next batch generates
        out += [f"trainer.mode={mode}", f"trainer.total_training_steps={args.warmup + args.steps + 1}"]
        out += placement_overrides(placement, rollout, world, on_gpu=work.bf16)
    return out + list(args.set)


def presets(work: Work, rollout: str) -> list[str]:
    """The ``--config`` presets of a run, as examples/grpo_fsdp.sh stacks them."""
    return [work.preset] + (["vllm_gpu"] if rollout == "vllm" and work.preset == "grpo_gsm8k" else [])


def placement_overrides(placement: str, rollout: str, world: int, on_gpu: bool) -> list[str]:
    """Where an overlapped run's rollout generates: beside the trainer (vLLM's engine core in a process of its
    own), or in a rollout process per trainer rank (vLLM in-process there) on the trainer's GPU (``process``) or
    on a GPU of its own (``disaggregated``: GPUs ``world`` to ``2 * world - 1``); the CPU smoke run's rollout
    process stays on the CPU."""
    if placement == "colocated":
        return ["rollout.executor=multiprocess"] if rollout == "vllm" else []
    out = ["trainer.rollout_placement=process"]
    if on_gpu:
        first = world if placement == "disaggregated" else 0
        out += [f"trainer.rollout_devices=[{','.join(f'cuda:{first + rank}' for rank in range(world))}]"]
    if rollout == "vllm":
        out += ["rollout.executor=inprocess"]
        if placement == "disaggregated":
            out += ["rollout.gpu_memory_utilization=0.85"]
    return out


class MemoryPeak:
    """The highest device memory in use (NVML, so vLLM's pool counts) seen every 50 ms, on a thread."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device, self.peak = torch, device, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.on = device.type == "cuda"
        if self.on:
            try:  # NVML (nvidia-ml-py) is a measurement here: without it the run still counts, unpeaked
                self.peak = torch.cuda.device_memory_used(device)
            except Exception as exc:  # noqa: BLE001
                print(
                    f"[rl-bench] no device memory reading ({exc}): peak_device_gib is null", file=sys.stderr
                )
                self.on = False
        if self.on:
            self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self.torch.cuda.device_memory_used(self.device))

    def close(self) -> float | None:
        self.stop.set()
        if not self.on:
            return None
        self.thread.join()
        return round(self.peak / 2**30, 2)


class GcClock:
    """Seconds Python's cyclic garbage collector ran, and its full (generation 2) collections, since
    :meth:`reset` (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        import gc

        self.gc, self.t0, self.seconds, self.full = gc, 0.0, 0.0, 0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self.t0
        self.full += info.get("generation") == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0

    def read(self) -> dict[str, float]:
        return {
            "gc_s": round(self.seconds, 3),
            "gc_full": self.full,
            "gc_tracked": len(self.gc.get_objects()),
        }

    def close(self) -> None:
        self.gc.callbacks.remove(self._tick)


def worker(spec_path: str) -> None:
    """Run one spec's steps in this process (one rank of it under torchrun) and write this rank's result."""
    import torch

    from posttrain.trainers.config import load_config
    from posttrain.trainers.rl.trainer import RLTrainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config(spec["overrides"], spec["presets"])
    start = time.perf_counter()
    trainer = RLTrainer(cfg)
    init_s = time.perf_counter() - start
    device = torch.device(trainer.actor.device) if trainer.actor.device is not None else torch.device("cpu")
    steps: list[dict[str, float]] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak = MemoryPeak(device)  # over every step, warm-up included, as bench/trl_grpo.py measures TRL
    gc_clock = GcClock()
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        gc_clock.reset()
        metrics = trainer.train_step()
        wall = time.perf_counter() - t0
        trainer.global_step += 1
        trainer.tracker.log(metrics, trainer.global_step)
        steps.append({**metrics, "wall_s": wall, "warmup": i < spec["warmup"], **gc_clock.read()})
    gc_clock.close()
    rank = int(os.environ.get("RANK", "0"))
    result = {
        "rank": rank,
        "init_s": init_s,
        "steps": steps,
        "peak_device_gib": peak.close(),
        "peak_torch_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    trainer.close()
    Path(spec["result"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the launcher
def launch(
    spec: dict[str, Any], launcher: str, world: int, run_dir: Path, timeout: int, script: str = __file__
) -> list[dict] | str:
    """Run ``script --worker SPEC`` as a subprocess; the ranks' results, or the error with the log's tail."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("result.rank*.json"):
        old.unlink()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "result": str(run_dir / "result.json")}))
    worker_argv = [str(Path(script).resolve()), "--worker", str(spec_path)]
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            *worker_argv,
        ]
    else:
        cmd = [sys.executable, *worker_argv]
    log = run_dir / "log.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, process_group=0)
        stop_run = lambda *_: (os.killpg(proc.pid, signal.SIGKILL), sys.exit(143))  # noqa: E731
        previous = signal.signal(signal.SIGTERM, stop_run)  # `timeout` stops this launcher: stop the run too
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # torchrun's workers too: the run has its own process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"timeout after {timeout}s"
        finally:
            signal.signal(signal.SIGTERM, previous)
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result.rank*.json"))]
    if rc != 0 or not results:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        return f"exit {rc}; log {log}:\n" + "\n".join(tail)
    return sorted(results, key=lambda r: r["rank"])


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    workdir = Path(args.workdir or "/tmp/rl_bench")
    launchers = csv(args.launchers, "process,torchrun")
    rollouts = csv(args.rollouts, "hf" if args.tiny else "hf,vllm")
    modes = csv(args.modes, "sync")
    placements = csv(args.placements, "colocated")
    bad = [x for x in launchers if x not in ("process", "torchrun")] + [
        x for x in rollouts if x not in ("hf", "vllm")
    ]
    bad += [x for x in modes if x not in MODES]
    bad += [x for x in placements if x not in ("colocated", "process", "disaggregated")]
    if bad:
        raise ValueError(
            f"unknown launcher/rollout/mode {bad}: launchers are process, torchrun; rollouts hf, vllm; "
            f"modes {', '.join(MODES)}; placements colocated, process, disaggregated"
        )
    rows, sha = [], commit()
    for name, work in plan(args):
        model = prepare_model(workdir, work.shape, work.vocab)
        data = prepare_data(workdir, model, work, work.prompts * args.gpus * (args.warmup + args.steps + 1))
        runs = [(r, la, m, p) for r in rollouts for la in launchers for m in modes for p in placements]
        for rollout, launcher, mode, placement in runs:
            if placement != "colocated" and mode == "sync":
                continue  # a rollout process only generates beside training
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
            got = launch(spec, launcher, world, run_dir, args.timeout)
            row = {"bench": "rl_throughput", "commit": sha, **label, **asdict(work)}
            row.update({"warmup": args.warmup, "steps": args.steps, "prompts": work.prompts * world})
            row.update(summarize(got, gpus) if isinstance(got, list) else {"error": got})
            row["overrides"] = spec["overrides"]
            rows.append(row)
            emit(row, args.json)
    print("\n" + table(rows))
    for r in rows:
        if "gen_s_each" in r:
            print(
                f"[rl-bench] {r['work']} {r['rollout']} {r['launcher']} {r['mode']}: gen s per step "
                f"{r['gen_s_each']} (warm-up first), drift {r.get('gen_drift')}, gc s {r.get('gc_s_each')}"
            )
    drifted = drift_failures(rows, DRIFT) if args.check_drift else []
    for line in drifted:
        print(f"[rl-bench] DRIFT: {line}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) and not drifted else 1


if __name__ == "__main__":
    raise SystemExit(main())
