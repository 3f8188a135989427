"""The RL trainer refuses to roll out from weights other than the ones it synced last (a sync that did not
take effect must never go unnoticed), and logs how far the rollout's log-probs are from the actor's."""

from __future__ import annotations

import pytest
from sft_fixtures import make_tiny_model

from posttrain.core.weight_sync import WeightSyncError
from posttrain.trainers.config import load_config
from posttrain.trainers.data.convert import write_parquet
from posttrain.trainers.data.synthetic import arithmetic_rows
from posttrain.trainers.rl.trainer import RLTrainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-version")
    splits = arithmetic_rows(8, 4, digits=1, seed=0)
    train = write_parquet(splits["train"], root / "train.parquet")
    cfg = load_config(
        [
            f"model.path={make_tiny_model(root)}",
            f"data.train_files=[{train}]",
            f"trainer.default_local_dir={root / 'run'}",
            "trainer.logger=[file]",
            "trainer.total_training_steps=2",
            "trainer.save_freq=-1",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "rollout.response_length=6",
        ],
        ["grpo_tiny"],
    )
    t = RLTrainer(cfg)
    yield t
    t.release()


def test_a_step_syncs_a_new_version_and_logs_the_logprob_gap(trainer):
    assert trainer.rollout.weight_version() == trainer.weight_version == 0
    metrics = trainer.train_step()
    trainer.global_step += 1
    assert trainer.rollout.weight_version() == trainer.weight_version == 1
    for key in ("rollout/logprob_diff/mean", "rollout/logprob_diff/max", "rollout/logprob_diff/kl"):
        assert key in metrics
    # Same weights, same float32 math on CPU: the rollout's log-probs are the actor's to rounding.
    assert metrics["rollout/logprob_diff/max"] < 1e-4 and abs(metrics["rollout/logprob_diff/kl"]) < 1e-6


def test_a_rollout_left_on_other_weights_stops_the_step(trainer):
    trainer.rollout._weight_version = trainer.weight_version - 1  # as if the last sync never committed
    with pytest.raises(WeightSyncError, match="serves weight version 0, but the actor's weights of step 1"):
        trainer.train_step()


def test_the_rollout_applies_model_override_config_as_the_actor_does(tmp_path):
    """``model.override_config`` changes the model (here its norm epsilon); the rollout the trainer builds
    applies it too, so its log-probs stay the actor's (a rollout without it would sample from another
    model)."""
    splits = arithmetic_rows(8, 4, digits=1, seed=0)
    cfg = load_config(
        [
            f"model.path={make_tiny_model(tmp_path)}",
            f"data.train_files=[{write_parquet(splits['train'], tmp_path / 'train.parquet')}]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.logger=[file]",
            "trainer.total_training_steps=1",
            "trainer.save_freq=-1",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "rollout.response_length=6",
            "model.override_config.rms_norm_eps=0.5",
        ],
        ["grpo_tiny"],
    )
    t = RLTrainer(cfg)
    try:
        assert t.rollout.model.config.rms_norm_eps == 0.5
        metrics = t.train_step()
        assert metrics["rollout/logprob_diff/max"] < 1e-4, metrics["rollout/logprob_diff/max"]
    finally:
        t.release()
