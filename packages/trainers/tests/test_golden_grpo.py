"""Golden curve: four GRPO steps of the tiny offline model on CPU, compared with
``golden/grpo_tiny_cpu.json``.

Per step the test compares the reward, the policy-gradient, KL and total losses, the clip fraction, the
entropy, the response length and the grad norm with the stored values: relative tolerance 1e-4 (absolute 1e-6
for values near zero). Not bitwise: float32 CPU kernels change their summation order between torch releases
(2.13 and 2.14 differ in the last bits) and CPU instruction sets, which moves these values by about 1e-6
relative; any change to the RL numerics (advantages, clipping, loss aggregation, KL, sampling, the weight
sync) moves them far more, and a sampled token that changes moves the reward and every later step. Torch runs
on one thread here (the thread count picks the CPU kernels), two optimizer steps per step (so the ratio leaves
1 and clipping acts).

After an intended change to the numerics, regenerate the file and say why in the commit::

    uv run python packages/trainers/tests/test_golden_grpo.py --update

To see a change show, compare a variant with the stored curve (exit 1 when it differs)::

    uv run python packages/trainers/tests/test_golden_grpo.py actor.clip_ratio_high=0.1
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from sft_fixtures import make_tiny_model

from posttrain.trainers.data.convert import write_parquet
from posttrain.trainers.data.synthetic import arithmetic_rows
from posttrain.trainers.logging import read_metrics
from posttrain.trainers.main_ppo import run

GOLDEN = Path(__file__).with_name("golden") / "grpo_tiny_cpu.json"
STEPS = 4
KEYS = (
    "reward/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/loss",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
)
RTOL, ATOL = 1e-4, 1e-6


def golden_args(root: Path, model: Path, train: Path) -> list[str]:
    """Every setting the curve depends on is written out, so a change of a preset default does not move it."""
    return [
        "--config",
        "grpo_tiny",
        f"model.path={model}",
        f"data.train_files=[{train}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "data.seed=1",
        f"trainer.default_local_dir={root / 'run'}",
        "trainer.logger=[file]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.seed=0",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "actor.optim.lr=2e-3",
        "actor.optim.clip_grad=1.0",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_epochs=2",
        "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.2",
        "actor.loss_agg_mode=token-mean",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.01",
        "actor.kl_loss_type=low_var_kl",
        "actor.entropy_coeff=0.0",
        "rollout.n=4",
        "rollout.temperature=1.0",
        "rollout.response_length=10",
        f"reward.custom_reward_function={Path(__file__).with_name('rl_rewards.py')}:digit_share",
    ]


def run_curve(root: Path, *overrides: str) -> list[dict[str, float]]:
    """The logged ``KEYS`` of each step of the golden run (``overrides`` appended), on one torch thread."""
    splits = arithmetic_rows(32, 8, digits=1, seed=0)
    train = write_parquet(splits["train"], root / "data" / "train.parquet")
    args = [*golden_args(root, make_tiny_model(root), train), *overrides]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(args, "grpo")
    finally:
        torch.set_num_threads(threads)
    return [
        {"step": r["step"], **{k: r[k] for k in KEYS}} for r in read_metrics(root / "run" / "metrics.jsonl")
    ]


def mismatches(got: list[dict[str, float]], want: list[dict[str, float]]) -> list[str]:
    """One line per value outside the tolerance (or a missing step)."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} != {[r['step'] for r in want]}"]
    return [
        f"step {g['step']} {k}: {g[k]!r} != golden {w[k]!r}"
        for g, w in zip(got, want)
        for k in KEYS
        if not math.isclose(g[k], w[k], rel_tol=RTOL, abs_tol=ATOL)
    ]


@pytest.mark.slow
def test_grpo_matches_golden_curve(tmp_path):
    want = json.loads(GOLDEN.read_text())["steps"]
    bad = mismatches(run_curve(tmp_path), want)
    assert not bad, (
        "GRPO left its golden curve (regenerate only for an intended change, see the docstring):\n"
        + ("\n".join(bad))
    )


def main(argv: list[str]) -> int:
    update = "--update" in argv
    overrides = [a for a in argv if a != "--update"]
    if update and overrides:
        raise SystemExit("--update writes the golden run itself: pass no overrides with it")
    with tempfile.TemporaryDirectory() as tmp:
        got = run_curve(Path(tmp), *overrides)
    if update:
        GOLDEN.parent.mkdir(exist_ok=True)
        doc = {
            "what": "4 GRPO steps of the tiny offline model on CPU (test_golden_grpo.py); "
            f"rtol {RTOL}, atol {ATOL}",
            "regenerate": "uv run python packages/trainers/tests/test_golden_grpo.py --update",
            "torch": torch.__version__,
            "steps": got,
        }
        GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    bad = mismatches(got, json.loads(GOLDEN.read_text())["steps"])
    print("\n".join(bad) if bad else "matches the golden curve")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
