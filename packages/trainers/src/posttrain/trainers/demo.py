"""``posttrain demo``: the whole pipeline on a CPU in minutes, with nothing downloaded.

1. ``posttrain model init --size tiny``: a random 0.35 M-parameter Qwen2 and a byte-level BPE chat tokenizer.
2. ``posttrain data synthetic --task largest``: "Which is the largest of 3, 8, 5?" -> "The largest is
   8.\\n#### 8", 800 training triples and 100 held-out ones.
3. SFT with the FSDP2 engine, stopped early on purpose: the model has the format and about half the answers.
4. GRPO with the FSDP2 engine and the HF rollout: 8 samples per prompt, rule reward 1 for the right number
   after ``####``, KL loss to the SFT model. Weights are synced into the rollout after every step
   (checksummed).
5. The test-set reward (greedy, exact match on the held-out triples) of the SFT model and of the GRPO model, a
   checkpoint, ``metrics.jsonl`` and ``metrics.png`` for both stages.

Why this task: a 0.35 M-parameter model memorises arithmetic facts rather than learning addition, so RL gains
on training sums do not reach unseen sums; "largest of three" it learns as a rule, so they do.

``posttrain demo --task calculator`` (or ``task=calculator``) runs the multi-turn version: "What is 47 * 83?"
with a ``calculator`` tool (posttrain-envs). SFT on tool-use traces (call, result, ``#### <product>``), then
GRPO through the agent loop (docs/agents.md): each episode calls the tool, reads its result and answers; the
environment scores the answer. The test-set reward is then the held-out success rate. The tiny model cannot
multiply; what it must learn is to copy the operands into the call and the tool's result into the answer. Its
own defaults: SFT until the first checkpoint (one every 10 steps) whose greedy success on 50 validation
questions reaches ``sft_pick=0.3``, at most 1200 steps (the copying is learned late, after a plateau, and then
within 30-40 steps; :mod:`.demo_pick` says why GRPO needs a checkpoint from that rise), then 20 GRPO steps
from that checkpoint at lr 1e-4 warmed up over the first 10, with episodes sampled at temperature 0.5 (see
docs/agents.md). The log names the checkpoint and why.

Every knob is a ``key=value`` override of :class:`DemoConfig`, e.g. ``posttrain demo grpo_steps=40``;
``posttrain demo --help`` lists them.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from posttrain.core.config.loader import ConfigError, merge_config

from . import main_ppo, sft
from .command import exit_code, fields_help
from .data.convert import write_parquet
from .data.synthetic import calculator_rows, largest_rows
from .demo_pick import SAVE_EVERY, Picker, check_sft_pick, greedy_success, hf_export, sft_until_picked
from .model_init import init_model


@dataclass(kw_only=True)
class DemoConfig:
    """The demo's knobs."""

    task: str = "largest"
    """``largest`` (single-turn) or ``calculator`` (multi-turn with a tool; needs posttrain-envs)."""
    model_size: str = "tiny"
    """``posttrain model init`` size: tiny or small (4 layers, hidden 256; several times slower on a CPU)."""
    out_dir: str = "outputs/demo"
    """Everything goes here: model/, data/, sft/, grpo/."""
    num_train: int = 800
    """Training questions."""
    num_test: int = 100
    """Test questions, never seen in training."""
    sft_steps: int | None = None
    """SFT optimizer steps (16 conversations each), at most with ``sft_pick``; None: the task's (largest 100,
    calculator 1200)."""
    grpo_steps: int | None = None
    """GRPO steps (16 prompts x 8 samples each, two optimizer steps of 8 prompts); None: the task's (largest
    40, calculator 20)."""
    grpo_lr: float | None = None
    """GRPO learning rate; None: the task's (largest 2e-4, calculator 1e-4)."""
    sft_pick: float | None = None
    """SFT saves a checkpoint every 10 steps and stops at the first whose greedy success on the ``num_val``
    validation questions reaches this, a rate in (0, 1]; GRPO starts from it, or from the last SFT step when
    none does. None: the task's (calculator 0.3; largest none: all ``sft_steps``, no validation questions)."""
    num_val: int = 50
    """Validation questions (neither trained on nor in the test set) that score the SFT checkpoints for
    ``sft_pick``."""
    seed: int = 0
    """Seed of the model init and the data."""
    trainer_mode: str = "sync"
    """GRPO's ``trainer.mode``: sync, one_step_off (the next step's rollout generates while this step trains)
    or async (see docs/rl.md)."""


def _last(metrics_path: Path, key: str) -> tuple[float | None, float | None]:
    """(first, last) logged value of ``key``."""
    values = [row[key] for row in map(json.loads, metrics_path.read_text().splitlines()) if key in row]
    return (values[0], values[-1]) if values else (None, None)


@dataclass(frozen=True)
class Task:
    """One demo task: its data, its defaults and its SFT and GRPO overrides."""

    rows: Callable[..., dict[str, list[dict]]]
    """``rows(num_train, num_test, seed=...)``: the train and test splits."""
    sft_steps: int
    """Default ``sft_steps``."""
    grpo_steps: int
    """Default ``grpo_steps``."""
    grpo_lr: float
    """Default ``grpo_lr``."""
    sft_pick: float | None = None
    """Default ``sft_pick`` (None: GRPO starts from the last SFT step)."""
    sft_args: tuple[str, ...] = ()
    """Overrides of the SFT stage."""
    grpo_args: tuple[str, ...] = ()
    """Overrides of the GRPO stage (also those of the checkpoint scoring: the agent and rollout keys)."""


TASKS = {
    "largest": Task(largest_rows, sft_steps=100, grpo_steps=40, grpo_lr=2e-4),
    "calculator": Task(
        calculator_rows,
        sft_steps=1200,
        grpo_steps=20,
        grpo_lr=1e-4,
        sft_pick=0.3,
        sft_args=("data.max_length=192",),
        grpo_args=(
            "actor.optim.lr_warmup_steps=10",
            "agent.env=calculator",
            "agent.max_turns=3",
            "agent.max_tokens_per_turn=96",
            "rollout.prompt_length=96",
            "rollout.response_length=160",
            "rollout.temperature=0.5",
        ),
    ),
}


def resolved(cfg: DemoConfig) -> DemoConfig:
    """``cfg`` with the task's defaults in place of the knobs left at None."""
    if cfg.task not in TASKS:
        raise ConfigError(f"task={cfg.task!r} is unknown: use one of {', '.join(TASKS)}")
    task = TASKS[cfg.task]
    sft_steps = task.sft_steps if cfg.sft_steps is None else cfg.sft_steps
    grpo_steps = task.grpo_steps if cfg.grpo_steps is None else cfg.grpo_steps
    grpo_lr = task.grpo_lr if cfg.grpo_lr is None else cfg.grpo_lr
    sft_pick = task.sft_pick if cfg.sft_pick is None else check_sft_pick(cfg.sft_pick)
    if sft_pick is not None and cfg.num_val < 1:
        raise ConfigError(
            f"num_val={cfg.num_val}: sft_pick={sft_pick} needs validation questions, set num_val>=1"
        )
    return replace(cfg, sft_steps=sft_steps, grpo_steps=grpo_steps, grpo_lr=grpo_lr, sft_pick=sft_pick)


def write_data(cfg: DemoConfig, out: Path) -> dict[str, Path]:
    """The task's parquet files by split: train, test and (with ``sft_pick``) val, the ``num_val`` questions
    after the test ones (so the train and test questions do not depend on ``num_val``)."""
    num_val = cfg.num_val if cfg.sft_pick is not None else 0
    splits = TASKS[cfg.task].rows(cfg.num_train, cfg.num_test + num_val, seed=cfg.seed)
    splits["test"], val = splits["test"][: cfg.num_test], splits["test"][cfg.num_test :]
    if val:
        splits["val"] = [
            {**r, "extra_info": {**r["extra_info"], "split": "val", "index": i}} for i, r in enumerate(val)
        ]
    return {s: write_parquet(rows, out / "data" / f"{s}.parquet") for s, rows in splits.items()}


def _sft(cfg: DemoConfig, model: Path, files: dict[str, Path], out: Path) -> tuple[int, Path]:
    """The SFT stage; (SFT step, its HF export) that GRPO starts from. With ``sft_pick`` it saves every
    :data:`~.demo_pick.SAVE_EVERY` steps, scores each checkpoint on the validation questions and stops at the
    first that reaches ``sft_pick`` (:mod:`.demo_pick`); the log says which and why."""
    sft_dir = out / "sft"
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['test']}]",
        "trainer.resume_mode=disable",
        f"trainer.total_training_steps={cfg.sft_steps}",
        f"trainer.default_local_dir={sft_dir}",
        "trainer.test_freq=-1",
        "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        *TASKS[cfg.task].sft_args,
    ]
    if cfg.sft_pick is None:
        sft.run(["--config", "sft_tiny", *overrides])
        return cfg.sft_steps, hf_export(sft_dir, cfg.sft_steps)

    def score(step: int) -> float:
        value = greedy_success(hf_export(sft_dir, step), files["val"], TASKS[cfg.task].grpo_args)
        print(
            f"\n[demo] SFT step {step}: greedy success {value:.2f} on {cfg.num_val} validation questions",
            file=sys.stderr,
        )
        return value

    every = [f"trainer.save_freq={SAVE_EVERY}", "checkpoint.max_ckpt_to_keep=1"]  # the pick is the last saved
    pick = sft_until_picked([*overrides, *every], Picker(score, cfg.sft_pick))
    print(f"[demo] GRPO starts from SFT {pick.reason}", file=sys.stderr)
    return pick.step, hf_export(sft_dir, pick.step)


def _grpo(cfg: DemoConfig, model: Path, files: dict[str, Path], out: Path) -> None:
    """The GRPO stage from ``model``, validated on the test questions before the first step and every 10."""
    main_ppo.run(
        [
            "--config",
            "grpo_tiny",
            f"model.path={model}",
            f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['test']}]",
            "trainer.resume_mode=disable",
            "trainer.val_before_train=true",
            f"trainer.total_training_steps={cfg.grpo_steps}",
            f"trainer.default_local_dir={out / 'grpo'}",
            "data.train_batch_size=16",
            "actor.ppo_mini_batch_size=8",
            f"actor.optim.lr={cfg.grpo_lr}",
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.001",
            "trainer.test_freq=10",
            f"trainer.mode={cfg.trainer_mode}",
            *TASKS[cfg.task].grpo_args,
        ],
        "grpo",
    )


def run(cfg: DemoConfig) -> dict[str, float]:
    """Model, data, SFT, the SFT checkpoint GRPO starts from, GRPO; the test-set rewards before and after
    GRPO."""
    cfg = resolved(cfg)
    out = Path(cfg.out_dir)
    start = time.perf_counter()
    stale = [out / d for d in ("model", "data", "sft", "grpo") if (out / d).exists()]
    if stale:
        print(f"[demo] replacing the previous demo run in {out}", file=sys.stderr)
        for path in stale:
            shutil.rmtree(path)
    model = init_model(out / "model", size=cfg.model_size, seed=cfg.seed)
    files = write_data(cfg, out)
    print(f"[demo] model {model}, data {out / 'data'} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    sft_step, sft_model = _sft(cfg, model, files, out)
    print(f"[demo] SFT done, GRPO from {sft_model} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    _grpo(cfg, sft_model, files, out)
    before, after = _last(out / "grpo" / "metrics.jsonl", "val/reward/mean")
    seconds = time.perf_counter() - start
    result = {"test_reward_sft": before, "test_reward_grpo": after, "sft_step": sft_step, "seconds": seconds}
    print(
        f"[demo] GRPO started from SFT step {sft_step}; curves: {out / 'sft' / 'metrics.png'}, "
        f"{out / 'grpo' / 'metrics.png'}; checkpoint: {out / 'grpo' / f'global_step_{cfg.grpo_steps}'}; "
        f"{seconds:.0f}s in total\n\n[demo] test-set reward (greedy, {cfg.num_test} held-out questions): "
        f"SFT model {before:.3f} -> GRPO model {after:.3f}"
    )
    return result


def usage() -> str:
    """``posttrain demo --help``: what the demo does and every knob with its default and meaning."""
    return (
        f"usage: posttrain demo [key=value ...]\n\n{__doc__.strip()}\n\nknobs (key=default):\n"
        f"{fields_help(DemoConfig)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if "--task" in args:  # posttrain demo --task calculator
        at = args.index("--task")
        args[at : at + 2] = [f"task={args[at + 1]}"] if at + 1 < len(args) else ["task="]
    return exit_code("posttrain demo", lambda: run(merge_config(DemoConfig(), [], args)))


if __name__ == "__main__":
    raise SystemExit(main())
