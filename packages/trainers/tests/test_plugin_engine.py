"""A third-party engine is a package with an entry point and a config class, nothing else:
posttrain-thin-engine (tests/plugin_engine, installed as a path dependency of this package's test group)
trains through ``posttrain sft`` and ``posttrain grpo`` with ``model_engine=thin``, its own key
(``engine.record_to``) reaching its engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from sft_fixtures import make_arithmetic, make_tiny_model

from posttrain.trainers import cli
from posttrain.trainers.config import load_config
from posttrain.trainers.data.convert import write_parquet
from posttrain.trainers.data.synthetic import arithmetic_rows
from posttrain.trainers.logging import read_metrics

STEPS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("thin"))


def test_the_loader_picks_the_plugin_config_for_its_name():
    from posttrain_thin_engine.config import ThinEngineConfig

    cfg = load_config(["model_engine=thin", "critic.engine.strategy=fsdp2", "actor.engine.record_to=x"])
    assert type(cfg.actor.engine) is ThinEngineConfig and cfg.actor.engine.record_to == "x"
    assert type(cfg.ref.engine) is ThinEngineConfig and cfg.ref.engine.forward_only
    assert type(cfg.critic.engine).__name__ == "FSDP2EngineConfig"


def test_sft_trains_with_the_plugin_engine(model, tmp_path):
    train, test = make_arithmetic(tmp_path, num_train=32, num_test=8)
    record = tmp_path / "record.txt"
    argv = [
        "sft",
        "--config",
        "sft_tiny",
        f"model.path={model}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[file]",
        f"trainer.total_training_steps={STEPS}",
        "model_engine=thin",
        f"actor.engine.record_to={record}",
    ]
    assert cli.main(argv) == 0
    assert record.read_text().splitlines() == ["ThinLanguageModelEngine language_model step"] * STEPS
    losses = [m["train/loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in m]
    assert len(losses) == STEPS and all(loss > 0 for loss in losses)


def test_grpo_trains_with_the_plugin_engine(model, tmp_path):
    splits = arithmetic_rows(16, 4, digits=1, seed=0)
    train = write_parquet(splits["train"], tmp_path / "train.parquet")
    record = tmp_path / "record.txt"
    argv = [
        "grpo",
        "--config",
        "grpo_tiny",
        f"model.path={model}",
        f"data.train_files=[{train}]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[file]",
        f"trainer.total_training_steps={STEPS}",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        "rollout.response_length=6",
        "model_engine=thin",
        f"actor.engine.record_to={record}",
        f"reward.custom_reward_function={Path(__file__).parent / 'rl_rewards.py'}:digit_share",
    ]
    assert cli.main(argv) == 0
    # two mini-batches per step: two optimizer steps of the thin actor per training step
    assert record.read_text().splitlines() == ["ThinLanguageModelEngine language_model step"] * (2 * STEPS)
    steps = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "actor/pg_loss" in m]
    assert len(steps) == STEPS
