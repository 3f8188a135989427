"""`posttrain demo` as it ships: model init -> data -> SFT (HF export) -> GRPO from that export, and GRPO must
raise the held-out reward.

The run uses the demo's defaults (100 SFT steps, 40 GRPO steps, 100 held-out questions) on one torch thread:
the thread count picks the CPU kernels, and so the sampled tokens, which makes the run reproducible. Measured
with torch 2.14 on CPU: SFT model 0.50 -> GRPO model 0.76 (the reward is still 0.48 at GRPO steps 10 to 30),
so the required gain of 0.15 leaves a margin of 0.11 (one held-out question is 0.01).

``--task calculator`` likewise (seed 0, one thread): SFT stops at step 480, the first checkpoint whose success
on the 50 validation questions reaches ``sft_pick=0.3`` (0.34); held-out 0.41 -> 0.52 after 20 GRPO steps, so
the required gain of 0.05 leaves a margin of 0.06. The picker and the early stop have quick tests of their own
below.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from sft_fixtures import make_arithmetic, make_tiny_model

from posttrain.trainers.data.synthetic import calculator_rows
from posttrain.trainers.demo import DemoConfig, main, resolved, run, write_data
from posttrain.trainers.demo_pick import Picker, hf_export, pick_checkpoint, sft_until_picked
from posttrain.trainers.logging import read_metrics

MIN_GAIN = 0.15
MIN_GAIN_CALCULATOR = 0.05


def run_on_one_thread(cfg: DemoConfig) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_demo_grpo_improves_the_held_out_reward(tmp_path):
    cfg = resolved(DemoConfig(out_dir=str(tmp_path)))
    result = run_on_one_thread(cfg)
    sft, grpo = result["test_reward_sft"], result["test_reward_grpo"]
    assert grpo >= sft + MIN_GAIN, f"GRPO did not raise the held-out reward: SFT {sft:.3f} -> GRPO {grpo:.3f}"
    sft_dir = tmp_path / "sft" / f"global_step_{cfg.sft_steps}" / "actor" / "huggingface"
    assert (sft_dir / "model.safetensors").is_file()
    rows = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(cfg.grpo_steps + 1)) and "reward/mean" in rows[-1]
    grpo_dir = tmp_path / "grpo" / f"global_step_{cfg.grpo_steps}"
    assert (tmp_path / "grpo" / "metrics.png").is_file() and grpo_dir.is_dir()


@pytest.mark.slow
def test_calculator_demo_grpo_raises_the_held_out_success_from_the_picked_checkpoint(tmp_path):
    cfg = resolved(DemoConfig(task="calculator", out_dir=str(tmp_path)))
    result = run_on_one_thread(cfg)
    sft, grpo = result["test_reward_sft"], result["test_reward_grpo"]
    assert grpo >= sft + MIN_GAIN_CALCULATOR, f"GRPO did not raise held-out success: {sft:.3f} -> {grpo:.3f}"
    step = result["sft_step"]
    assert step < cfg.sft_steps and step % 10 == 0  # stopped at a picked checkpoint, not at the cap
    assert [p.name for p in (tmp_path / "sft").glob("global_step_*")] == [f"global_step_{step}"]
    assert read_metrics(tmp_path / "sft" / "metrics.jsonl")[-1]["step"] == step


# ---------------------------------------------------------------- the SFT checkpoint picker (sft_pick), quick


def read_rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def scored(table: dict[int, float]):
    """A score function over known checkpoint scores that records the steps it was asked for."""
    asked: list[int] = []

    def score(step: int) -> float:
        asked.append(step)
        return table[step]

    return score, asked


def test_the_picker_takes_the_first_checkpoint_that_reaches_sft_pick_and_scores_no_later_one():
    score, asked = scored({50: 0.1, 100: 0.42, 150: 0.5, 200: 0.9, 250: 0.3})
    pick = pick_checkpoint([250, 100, 50, 200, 150], score, 0.5)
    assert pick.step == 150 and asked == [50, 100, 150]
    assert pick.scores == {50: 0.1, 100: 0.42, 150: 0.5}
    assert (
        pick.reason.startswith("step 150: the first checkpoint")
        and "0.50 reaches sft_pick=0.5" in pick.reason
    )


def test_the_picker_falls_back_to_the_last_step_when_no_checkpoint_reaches_sft_pick():
    score, asked = scored({50: 0.1, 100: 0.45, 150: 0.2})
    pick = pick_checkpoint([50, 100, 150], score, 0.5)
    assert pick.step == 150 and asked == [50, 100, 150]
    assert pick.reason == "step 150, the last: no checkpoint reached sft_pick=0.5 (best 0.45 at step 100)"


def test_the_picker_takes_checkpoints_in_order_and_none_after_the_pick():
    score, _ = scored({50: 0.1, 100: 0.6, 150: 0.9})
    picker = Picker(score, 0.5)
    assert not picker.offer(50)
    with pytest.raises(ValueError, match="step 50 offered after step 50: offer steps in order"):
        picker.offer(50)
    assert picker.offer(100) and picker.pick().step == 100
    with pytest.raises(ValueError, match=r"step 150 offered after the pick \(step 100\)"):
        picker.offer(150)
    with pytest.raises(ValueError, match="saved none"):
        Picker(score, 0.5).pick()


@pytest.mark.parametrize(("reached_at", "saved"), [(4, [2, 4]), (None, [2, 4, 6, 7])])
def test_sft_stops_after_the_checkpoint_the_picker_takes(tmp_path, reached_at, saved):
    """A real SFT run on the tiny model, saving every 2 steps of 7; the score reaches 0.5 at
    ``reached_at``."""
    model = make_tiny_model(tmp_path)
    train, _ = make_arithmetic(tmp_path, num_train=32, num_test=4)
    score, asked = scored({s: float(reached_at is not None and s >= reached_at) for s in range(1, 8)})
    overrides = [f"model.path={model}", f"data.train_files=[{train}]", "trainer.total_training_steps=7"]
    out = tmp_path / "sft"
    overrides += [f"trainer.default_local_dir={out}", "trainer.save_freq=2", "trainer.logger=[file]"]
    pick = sft_until_picked([*overrides, "checkpoint.save_contents=[model,hf_model]"], Picker(score, 0.5))
    last = saved[-1]
    assert pick.step == last and asked == saved
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, last + 1))
    assert sorted(int(p.name.removeprefix("global_step_")) for p in out.glob("global_step_*")) == saved
    assert (hf_export(out, last) / "model.safetensors").is_file()


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), True, "half"])
def test_a_bad_sft_pick_is_refused_naming_the_fix(bad):
    score, asked = scored({50: 1.0})
    with pytest.raises(
        ValueError, match=r"sft_pick=.* is not a success rate in \(0, 1\]: set e.g. sft_pick=0.3"
    ):
        pick_checkpoint([50], score, bad)
    assert asked == []
    with pytest.raises(ValueError, match="set e.g. sft_pick=0.3"):
        resolved(DemoConfig(task="calculator", sft_pick=bad))


def test_sft_pick_defaults_and_the_command_line(tmp_path):
    assert resolved(DemoConfig(task="calculator")).sft_pick == 0.3
    assert resolved(DemoConfig(task="calculator", sft_pick=0.7)).sft_pick == 0.7
    assert resolved(DemoConfig(task="largest")).sft_pick is None
    with pytest.raises(ValueError, match="num_val>=1"):
        resolved(DemoConfig(task="calculator", num_val=0))
    assert main(["--task", "calculator", "sft_pick=1.5", f"out_dir={tmp_path}"]) == 2
    assert not any(tmp_path.iterdir())


def test_the_validation_questions_are_neither_trained_on_nor_tested(tmp_path):
    cfg = resolved(DemoConfig(task="calculator", num_train=40, num_test=10, num_val=5))
    files = write_data(cfg, tmp_path / "picked")
    plain = write_data(resolved(DemoConfig(task="largest", num_train=40, num_test=10)), tmp_path / "plain")
    questions = {s: [r["extra_info"]["question"] for r in read_rows(f)] for s, f in files.items()}
    assert [len(questions[s]) for s in ("train", "test", "val")] == [40, 10, 5] and "val" not in plain
    assert not set(questions["val"]) & (set(questions["train"]) | set(questions["test"]))
    unpicked = calculator_rows(40, 10, seed=0)  # the test questions do not depend on num_val
    assert [r["extra_info"]["question"] for r in unpicked["test"]] == questions["test"]
