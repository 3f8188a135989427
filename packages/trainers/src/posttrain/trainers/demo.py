"""``posttrain demo``: the whole pipeline on a CPU in minutes, with nothing downloaded.

1. ``posttrain model init --size tiny``: a random 0.35 M-parameter Qwen2 and a byte-level BPE chat tokenizer.
2. ``posttrain data synthetic --task largest``: "Which is the largest of 3, 8, 5?" -> "The largest is 8.\\n#### 8",
   800 training triples and 100 held-out ones.
3. SFT with the FSDP2 engine, stopped early on purpose: the model has the format and about half the answers.
4. GRPO with the FSDP2 engine and the HF rollout: 8 samples per prompt, rule reward 1 for the right number after
   ``####``, KL loss to the SFT model. Weights are synced into the rollout after every step (checksummed).
5. The test-set reward (greedy, exact match on the held-out triples) of the SFT model and of the GRPO model, a
   checkpoint, ``metrics.jsonl`` and ``metrics.png`` for both stages.

Why this task: a 0.35 M-parameter model memorises arithmetic facts rather than learning addition, so RL gains on
training sums do not reach unseen sums; "largest of three" it learns as a rule, so they do.

``posttrain demo --task calculator`` (or ``task=calculator``) runs the multi-turn version: "What is 47 * 83?"
with a ``calculator`` tool (posttrain-envs). SFT on tool-use traces (call, result, ``#### <product>``), then GRPO
through the agent loop (docs/agents.md): each episode calls the tool, reads its result and answers; the
environment scores the answer. The test-set reward is then the held-out success rate. The tiny model cannot
multiply; what it must learn is to copy the operands into the call and the tool's result into the answer. Its
own defaults: 800 SFT steps (the copying is learned late, after a plateau), 20 GRPO steps at lr 1e-4 with episodes
sampled at temperature 0.5 (see docs/agents.md for why).

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
    """SFT optimizer steps (16 conversations each); None: the task's (largest 100, calculator 800)."""
    grpo_steps: int | None = None
    """GRPO steps (16 prompts x 8 samples each, two optimizer steps of 8 prompts); None: the task's (largest
    40, calculator 20)."""
    grpo_lr: float | None = None
    """GRPO learning rate; None: the task's (largest 2e-4, calculator 1e-4)."""
    seed: int = 0
    """Seed of the model init and the data."""
    trainer_mode: str = "sync"
    """GRPO's ``trainer.mode``: sync, one_step_off (the next step's rollout generates while this step trains) or
    async (see docs/rl.md)."""


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
    sft_args: tuple[str, ...] = ()
    grpo_args: tuple[str, ...] = ()


TASKS = {
    "largest": Task(largest_rows, sft_steps=100, grpo_steps=40, grpo_lr=2e-4),
    "calculator": Task(
        calculator_rows,
        sft_steps=800,
        grpo_steps=20,
        grpo_lr=1e-4,
        sft_args=("data.max_length=192",),
        grpo_args=(
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
    return replace(cfg, sft_steps=sft_steps, grpo_steps=grpo_steps, grpo_lr=grpo_lr)


def run(cfg: DemoConfig) -> dict[str, float]:
    cfg = resolved(cfg)
    task = TASKS[cfg.task]
    out = Path(cfg.out_dir)
    start = time.perf_counter()
    stale = [out / d for d in ("model", "data", "sft", "grpo") if (out / d).exists()]
    if stale:
        print(f"[demo] replacing the previous demo run in {out}", file=sys.stderr)
        for path in stale:
            shutil.rmtree(path)
    model = init_model(out / "model", size=cfg.model_size, seed=cfg.seed)
    splits = task.rows(cfg.num_train, cfg.num_test, seed=cfg.seed)
    train, test = (write_parquet(splits[s], out / "data" / f"{s}.parquet") for s in ("train", "test"))
    print(f"[demo] model {model}, data {train.parent} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    data = [f"data.train_files=[{train}]", f"data.val_files=[{test}]", "trainer.resume_mode=disable"]
    sft.run(
        [
            "--config",
            "sft_tiny",
            f"model.path={model}",
            *data,
            f"trainer.total_training_steps={cfg.sft_steps}",
            f"trainer.default_local_dir={out / 'sft'}",
            "trainer.test_freq=-1",
            "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            *task.sft_args,
        ]
    )
    sft_model = out / "sft" / f"global_step_{cfg.sft_steps}" / "actor" / "huggingface"
    print(f"[demo] SFT done, model at {sft_model} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    main_ppo.run(
        [
            "--config",
            "grpo_tiny",
            f"model.path={sft_model}",
            *data,
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
            *task.grpo_args,
        ],
        "grpo",
    )
    before, after = _last(out / "grpo" / "metrics.jsonl", "val/reward/mean")
    result = {"test_reward_sft": before, "test_reward_grpo": after, "seconds": time.perf_counter() - start}
    print(
        f"\n[demo] test-set reward (greedy, {cfg.num_test} held-out questions): SFT model {before:.3f} -> "
        f"GRPO model {after:.3f}\n[demo] curves: {out / 'sft' / 'metrics.png'}, {out / 'grpo' / 'metrics.png'}; "
        f"checkpoint: {out / 'grpo' / f'global_step_{cfg.grpo_steps}'}; {result['seconds']:.0f}s in total"
    )
    return result


def usage() -> str:
    """``posttrain demo --help``: what the demo does and every knob with its default and meaning."""
    return f"usage: posttrain demo [key=value ...]\n\n{__doc__.strip()}\n\nknobs (key=default):\n{fields_help(DemoConfig)}"


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
