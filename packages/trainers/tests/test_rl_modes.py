"""trainer.mode one_step_off / async on the tiny offline model (CPU, HF rollout in a background thread): async
with max_staleness=0 is sync bitwise, one_step_off trains on one-version-old samples whose behaviour log-probs
are the old policy's (checked against log-probs computed here from the saved weights), a resumed one_step_off
run equals the uninterrupted one bitwise (the checkpoint holds the buffered rollouts), and stale_policy=drop
drops."""

from __future__ import annotations

import pytest
import torch
from test_rl import STEPS, assets, grpo_args  # noqa: F401  (assets is a fixture)

from posttrain.ckpt import load_full_model_state
from posttrain.trainers.config import load_config
from posttrain.trainers.logging import read_metrics
from posttrain.trainers.main_ppo import run
from posttrain.trainers.rl.trainer import RLTrainer

COMPARED = (
    "reward/mean",
    "actor/loss",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/kl_loss",
    "response_length/mean",
)
GRPO = ("algorithm.adv_estimator=grpo",)


def assert_same_run(a, b, steps, last: int = STEPS) -> None:
    rows_a = {r["step"]: r for r in read_metrics(a / "metrics.jsonl")}
    rows_b = {r["step"]: r for r in read_metrics(b / "metrics.jsonl")}
    for step in steps:
        for key in COMPARED + (("val/reward/mean",) if "val/reward/mean" in rows_a[step] else ()):
            assert rows_a[step][key] == rows_b[step][key], (step, key, rows_a[step][key], rows_b[step][key])
    wa = load_full_model_state(a / f"global_step_{last}" / "actor" / "dist_ckpt")
    wb = load_full_model_state(b / f"global_step_{last}" / "actor" / "dist_ckpt")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def sync_run(assets):  # noqa: F811
    run_dir = assets["root"] / "modes_sync"
    run(grpo_args(assets, run_dir, *GRPO), "grpo")
    return run_dir


@pytest.fixture(scope="module")
def one_step_off_run(assets):  # noqa: F811
    run_dir = assets["root"] / "modes_one_step_off"
    run(grpo_args(assets, run_dir, *GRPO, "trainer.mode=one_step_off"), "grpo")
    return run_dir


def test_max_staleness_zero_reproduces_sync_bitwise(assets, sync_run, tmp_path):  # noqa: F811
    run(grpo_args(assets, tmp_path, *GRPO, "trainer.mode=async", "trainer.max_staleness=0"), "grpo")
    assert_same_run(sync_run, tmp_path, range(1, STEPS + 1))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["rollout/staleness/max"] == 0 and r["rollout/dropped_groups"] == 0 for r in rows)


def test_one_step_off_trains_on_samples_one_version_old(sync_run, one_step_off_run):
    rows = read_metrics(one_step_off_run / "metrics.jsonl")
    assert [r["rollout/staleness/mean"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    assert all(r["rollout/staleness/count_1"] == 16 for r in rows[1:])  # 4 prompts x 4 samples, one rank
    for key in (
        "perf/trainer_idle_s",
        "perf/rollout_idle_s",
        "timing_s/wait_rollout",
        "timing_s/update_weights",
    ):
        assert key in rows[-1], key
    sync_rows = read_metrics(sync_run / "metrics.jsonl")
    assert rows[0]["actor/loss"] == sync_rows[0]["actor/loss"], "step 1 trains on the same on-policy batch"
    assert rows[1]["actor/loss"] != sync_rows[1]["actor/loss"], "step 2 trains on samples of version 0"


def test_resumed_one_step_off_equals_the_uninterrupted_run(assets, one_step_off_run, tmp_path):  # noqa: F811
    run(
        grpo_args(
            assets,
            tmp_path,
            *GRPO,
            "trainer.mode=one_step_off",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={one_step_off_run / 'global_step_2'}",
        ),
        "grpo",
    )
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [3, 4]
    assert_same_run(one_step_off_run, tmp_path, [3, 4])


@pytest.mark.dist
@pytest.mark.slow
def test_one_step_off_in_a_rollout_process_equals_colocated(assets, one_step_off_run, tmp_path):  # noqa: F811
    """The worker process builds the same rollout, takes the same weights (over gloo instead of in-process)
    and samples with the same seeds on as many threads (trainer.rollout_threads=1) as the colocated rollout's
    thread: metrics, validation and final weights are equal bitwise."""
    placement = ["trainer.mode=one_step_off", "trainer.rollout_placement=process"]
    run(grpo_args(assets, tmp_path, *GRPO, *placement), "grpo")
    assert_same_run(one_step_off_run, tmp_path, range(1, STEPS + 1))


def _hand_log_probs(model, batch) -> torch.Tensor:
    """(T,) float64 log-probs of every response token under ``model`` at the batch's temperature, 0
    elsewhere."""
    out = torch.zeros(batch.input_ids.numel(), dtype=torch.float64)
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:]):
            ids = batch.input_ids[a:b]
            logits = model(ids[None]).logits[0].double() / batch.fields["temperature"][a:b, None].double()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
            out[a + 1 : b] = lp
    return out * batch.loss_mask.double()


def test_one_step_off_corrects_with_the_behaviour_policys_log_probs(assets, tmp_path):  # noqa: F811
    """Step 2 of one_step_off trains on samples of version 0 with the actor at version 1: the batch's
    behaviour log-probs are version 0's (the initial model, recomputed here), its old log-probs version 1's,
    and the TIS weights are min(exp(old - behaviour), cap) of those, in float64."""
    from transformers import AutoModelForCausalLM

    overrides = [*GRPO, "trainer.mode=one_step_off", "actor.optim.lr=0.02", "trainer.save_freq=-1"]
    overrides += ["algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.cap=1.01"]
    trainer = RLTrainer(load_config(grpo_args(assets, tmp_path, *overrides)[2:], ["grpo_tiny"]))
    batches = []
    update_models = trainer._update_models
    trainer._update_models = lambda batch, timer: batches.append(batch) or update_models(batch, timer)
    try:
        trainer.train_step()
        trainer.global_step += 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    batch = batches[1]
    assert batch.seq_fields["policy_version"].tolist() == [0] * batch.num_seqs
    v0 = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    behaviour = _hand_log_probs(v0, batch)
    mask = batch.loss_mask.bool()
    assert (batch.fields["rollout_log_probs"].double() - behaviour)[mask].abs().max() < 1e-4
    gap = (batch.fields["old_log_probs"].double() - behaviour)[mask].abs()
    assert gap.max() > 1e-2, "version 1 should differ from version 0 at this learning rate"
    want = torch.clamp(torch.exp(batch.fields["old_log_probs"].double() - behaviour), max=1.01) * mask
    assert (batch.fields["is_weights"].double() - want).abs().max() < 1e-4
    clipped = float(
        (torch.exp(batch.fields["old_log_probs"].double() - behaviour) > 1.01)[mask].double().mean()
    )
    assert 0 < metrics["rollout/is_weight/clipped_frac"] == pytest.approx(clipped, abs=0.02)


def test_drop_policy_drops_groups_staler_than_the_bound(assets, tmp_path):  # noqa: F811
    args = [*GRPO, "trainer.mode=async", "trainer.max_staleness=0", "trainer.stale_policy=drop"]
    run(grpo_args(assets, tmp_path, *args, "trainer.total_training_steps=2", "trainer.save_freq=-1"), "grpo")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout/dropped_groups"] for r in rows] == [
        0.0,
        4.0,
    ]  # step 2's prefetched batch was version 0
    assert all(r["rollout/staleness/max"] == 0 for r in rows)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.mode=offpolicy"], r"trainer.mode='offpolicy': choose one of sync, one_step_off, async"),
        (["trainer.stale_policy=skip"], r"trainer.stale_policy='skip'"),
        (["trainer.max_staleness=-1"], r"trainer.max_staleness=-1 must be >= 0"),
        (
            ["trainer.rollout_placement=remote"],
            r"trainer.rollout_placement='remote': choose one of colocated",
        ),
        (
            ["trainer.rollout_placement=process"],
            r"process with trainer.mode=sync.*set trainer.mode=one_step_off",
        ),
        (
            [
                "trainer.mode=one_step_off",
                "trainer.rollout_placement=colocated",
                "trainer.rollout_devices=[cuda:1]",
            ],
            r"rollout_devices=\['cuda:1'\] with "
            r"trainer.rollout_placement=colocated.*rollout_placement=process",
        ),
        (
            ["trainer.rollout_devices=[cuda:1]"],
            r"rollout_devices=\['cuda:1'\] with trainer.mode=sync.*set trainer.mode=one_step_off",
        ),
        (
            [
                "trainer.mode=one_step_off",
                "trainer.rollout_placement=process",
                "trainer.rollout_devices=[gpu1]",
            ],
            r"rollout_devices entry 'gpu1': use cpu or cuda:N",
        ),
    ],
)
def test_mode_config_refusals(overrides, match):
    from posttrain.core.config.loader import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(overrides, ["grpo_tiny"])


def test_remax_is_refused_outside_sync(assets, tmp_path):  # noqa: F811
    cfg = load_config(
        grpo_args(assets, tmp_path, "algorithm.adv_estimator=remax", "trainer.mode=one_step_off")[2:],
        ["grpo_tiny"],
    )
    with pytest.raises(ValueError, match="greedy baseline inside the step"):
        RLTrainer(cfg)


@pytest.mark.dist
@pytest.mark.slow
def test_two_processes_async_staleness_zero_equals_sync_and_one_step_off_runs(assets, tmp_path):  # noqa: F811
    """Two gloo ranks, each with its rollout thread: async max_staleness=0 equals sync bitwise (every rank
    makes the same collective calls in both), and one_step_off trains on one-version-old samples."""
    from posttrain.core.testing import torchrun

    common = [*GRPO, "trainer.n_gpus_per_node=2", "trainer.save_freq=-1", "data.val_files=[]"]
    common += ["trainer.total_training_steps=2"]
    runs = {
        "sync": [],
        "async0": ["trainer.mode=async", "trainer.max_staleness=0"],
        "one_step_off": ["trainer.mode=one_step_off"],
    }
    for name, extra in runs.items():
        torchrun(
            "posttrain.trainers.main_ppo", *grpo_args(assets, tmp_path / name, *common, *extra), module=True
        )
    assert_same_run(tmp_path / "sync", tmp_path / "async0", [1, 2], last=2)
    rows = read_metrics(tmp_path / "one_step_off" / "metrics.jsonl")
    assert [r["rollout/staleness/mean"] for r in rows] == [0.0, 1.0]
