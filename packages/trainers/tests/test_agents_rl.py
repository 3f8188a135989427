"""Multi-turn GRPO through the trainer on the tiny offline model (CPU, HF rollout): the batch trains on the
model's ids only, a resumed run (sync, and one_step_off with finished episodes in its buffer at the save)
equals the uninterrupted one bitwise, and so does a run whose episodes a rollout process plays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sft_fixtures import make_tiny_model

from posttrain.ckpt import load_full_model_state
from posttrain.core.env import Environment, StepResult, Turn
from posttrain.trainers.data.convert import write_parquet
from posttrain.trainers.data.synthetic import arithmetic_rows
from posttrain.trainers.logging import read_metrics
from posttrain.trainers.main_ppo import run

STEPS = 4
ENV = f"{Path(__file__).stem}:KeepTalking"


class KeepTalking(Environment):
    """Answers every turn with a user message until the third turn; the reward counts the digits written."""

    resets = 0
    """Episodes this process started (a rollout process's episodes count in that process)."""

    def reset(self, row):
        KeepTalking.resets += 1
        self.turns = 0
        return super().reset(row)

    def step(self, turn: Turn) -> StepResult:
        self.turns += 1
        if self.turns == 3:
            return StepResult(reward=float(sum(c.isdigit() for c in turn.text)), done=True)
        return StepResult(observation=[{"role": "user", "content": "And then?"}])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_rl")
    splits = arithmetic_rows(32, 8, digits=1, seed=0)
    return {
        "root": root,
        "model": make_tiny_model(root),
        "train": write_parquet(splits["train"], root / "data" / "train.parquet"),
    }


def args(assets, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        "grpo_tiny",
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[file]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=8",
        "rollout.prompt_length=64",
        "rollout.response_length=160",
        "actor.optim.lr=1e-3",
        f"agent.env={ENV}",
        "agent.max_turns=3",
        "agent.max_tokens_per_turn=48",
        "agent.truncated_reward=null",  # truncated episodes: the reward function over their text
        f"reward.custom_reward_function={Path(__file__).parent / 'rl_rewards.py'}:digit_share",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_multi_turn_grpo_resumes_bitwise(assets, mode, tmp_path):
    reference = tmp_path / "reference"
    run(args(assets, reference, f"trainer.mode={mode}"), "grpo")
    rows = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert max(r["reward/extra/agent/turns/mean"] for r in rows) > 1  # some episodes went past one turn
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    resumed = tmp_path / "resumed"
    run(
        args(
            assets,
            resumed,
            f"trainer.mode={mode}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={reference / 'global_step_2'}",
        ),
        "grpo",
    )
    ref_rows = {r["step"]: r for r in rows}
    new_rows = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in new_rows] == [3, 4]
    for row in new_rows:
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "reward/extra/agent/turns/mean"):
            assert row[key] == ref_rows[row["step"]][key], (row["step"], key)
    a = load_full_model_state(reference / f"global_step_{STEPS}" / "actor" / "dist_ckpt")
    b = load_full_model_state(resumed / f"global_step_{STEPS}" / "actor" / "dist_ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
@pytest.mark.slow
def test_episodes_in_a_rollout_process_equal_colocated(assets, tmp_path):
    """one_step_off with ``trainer.rollout_placement=process``: the worker builds the agent loop from the
    trainer's tokenizer and plays every episode itself (the trainer's process starts none), with the same
    seeds on as many threads as the colocated rollout's thread, so metrics and final weights are equal
    bitwise."""
    rows = {}
    for placement in ("colocated", "process"):
        before = KeepTalking.resets
        extra = [
            "trainer.mode=one_step_off",
            f"trainer.rollout_placement={placement}",
            "trainer.save_freq=-1",
        ]
        run(args(assets, tmp_path / placement, *extra), "grpo")
        started_here = KeepTalking.resets - before
        assert (started_here > 0) == (placement == "colocated"), (placement, started_here)
        rows[placement] = read_metrics(tmp_path / placement / "metrics.jsonl")
    assert max(r["reward/extra/agent/turns/mean"] for r in rows["process"]) > 1
    for ours, theirs in zip(rows["colocated"], rows["process"], strict=True):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "reward/extra/agent/turns/mean"):
            assert ours[key] == theirs[key], (ours["step"], key)
    a = load_full_model_state(tmp_path / "colocated" / f"global_step_{STEPS}" / "actor" / "dist_ckpt")
    b = load_full_model_state(tmp_path / "process" / f"global_step_{STEPS}" / "actor" / "dist_ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
