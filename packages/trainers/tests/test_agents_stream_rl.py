"""``trainer.mode=stream`` through the trainer on the tiny offline model (CPU, the HF rollout's ``agenerate``,
the ``calculator`` environment), with the pool in the trainer's process or in its rollout process: a few
steps, a checkpoint whose buffer holds finished groups, a resume that trains each of them exactly once and no
prompt that was trained before the save; and stream's config refusals."""

from __future__ import annotations

import pytest
import torch
from test_agents_rl import STEPS, args, assets  # noqa: F401  (assets is a fixture)

from posttrain.trainers.logging import read_metrics
from posttrain.trainers.main_ppo import run
from posttrain.trainers.rl.streaming import StreamRollouts

N = 4
STREAM = [
    "trainer.mode=stream",
    "agent.env=calculator",
    "agent.loop=async",
    f"rollout.n={N}",
    "agent.max_tokens_per_turn=24",
    "trainer.max_staleness=3",  # nothing dropped: every saved group is trained after the resume
]


def trained_groups(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """Records (step, the group's prompt ids) of every group the source hands the trainer."""
    seen: list[tuple[int, tuple[int, ...]]] = []
    next_batch = StreamRollouts.next_batch

    def recording(self, step, timer):
        out = next_batch(self, step, timer)
        seen.extend((step, tuple(s.prompt_ids)) for s in out[1]["samples"][::N])
        return out

    monkeypatch.setattr(StreamRollouts, "next_batch", recording)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "process"])
def test_stream_mode_trains_and_resumes_every_saved_group_once(
    assets,  # noqa: F811
    tmp_path,
    monkeypatch,
    placement,
):
    """With ``trainer.rollout_placement=process`` the pool, the episodes and the HF rollout run in the rollout
    process, and the same holds: the buffer of finished groups lives in the trainer."""
    seen = trained_groups(monkeypatch)
    reference = tmp_path / "reference"
    stream = [*STREAM, f"trainer.rollout_placement={placement}"]
    run(args(assets, reference, *stream), "grpo")
    rows = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/dropped_groups"] == 0 for r in rows)
    assert all(r["rollout/stream/episodes_in_flight"] <= 4 * N for r in rows)  # the cap: one batch's episodes
    assert rows[0]["rollout/stream/episodes_in_flight"] > 0  # (the last step's pool was drained at the save)
    assert max(r["rollout/staleness/max"] for r in rows) >= 1  # groups finished across weight pushes
    before = [g for step, g in seen if step < 2]
    state = torch.load(reference / "global_step_2" / "data_rank_0.pt", weights_only=False)["stream"]
    saved = [tuple(g["samples"][0]["prompt_ids"]) for g in state["buffer"]["groups"]]
    assert len(saved) == 8 and len(set(before)) == len(before) == 8
    assert sorted(g for step, g in seen if step >= 2) == sorted(saved)  # the uninterrupted run trains them

    seen.clear()
    resumed = tmp_path / "resumed"
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={reference / 'global_step_2'}"]
    run(args(assets, resumed, *stream, *resume), "grpo")
    assert sorted(g for _, g in seen) == sorted(saved)  # each saved group once, nothing else
    assert not set(before) & {g for _, g in seen}  # no prompt on both sides of the save
    ref_rows = {r["step"]: r for r in rows}
    for row in read_metrics(resumed / "metrics.jsonl"):
        for key in ("reward/mean", "actor/loss"):
            assert row[key] == ref_rows[row["step"]][key], (row["step"], key)


@pytest.mark.parametrize("in_process", [False, True], ids=["colocated", "rollout-process"])
def test_stream_mode_refuses_a_rollout_without_agenerate(in_process):
    """Colocated, the rollout's own ``agenerate``; for a rollout process's handle (which has no ``agenerate``
    but can open a pool), the ``serves_requests`` it carries, as its worker reported it at start-up."""
    from types import SimpleNamespace

    from posttrain.core.rollout import BaseRollout

    class BatchOnly(BaseRollout):
        serves_requests = False  # a rollout process's handle: its worker's rollout has no agenerate

        def generate(self, prompts, sampling):
            raise NotImplementedError

        def update_weights(self, weights, **kwargs):
            raise NotImplementedError

        def episode_stream(self, **kwargs):
            raise AssertionError("not to be opened")

    if not in_process:
        del BatchOnly.serves_requests, BatchOnly.episode_stream
    sampler = SimpleNamespace(rollout=BatchOnly())
    with pytest.raises(ValueError, match=r"trainer.mode=stream needs .*agenerate.*BatchOnly does not"):
        StreamRollouts(
            max_episodes=8,
            bound=1,
            threads=1,
            sampler=sampler,
            weights=None,
            draw=None,
            replicas=None,
            prompts_per_rank=2,
            total_steps=2,
        )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.mode=stream"], r"trainer.mode=stream streams agent episodes: set agent.env"),
        (
            ["trainer.mode=stream", "agent.env=calculator"],
            r"trainer.mode=stream with agent.loop=batched.*set agent.loop=async",
        ),
        (["trainer.stream_episodes=64"], r"trainer.stream_episodes=64 with trainer.mode=sync"),
    ],
)
def test_stream_mode_config_refusals(overrides, match):
    from posttrain.core.config.loader import ConfigError
    from posttrain.trainers.config import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(overrides, ["grpo_tiny"])


@pytest.mark.slow
def test_a_stream_checkpoint_resumes_in_stream_mode_only(assets, tmp_path):  # noqa: F811
    """The finished groups a stream checkpoint holds are not read by one_step_off: refused, naming the
    mode."""
    run(args(assets, tmp_path / "run", *STREAM, "trainer.total_training_steps=2"), "grpo")
    resume = [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'run' / 'global_step_2'}",
    ]
    other = [o for o in STREAM if o != "trainer.mode=stream"] + ["trainer.mode=one_step_off"]
    with pytest.raises(
        ValueError, match=r"saved by trainer.mode=stream .* resume it with trainer.mode=stream"
    ):
        run(args(assets, tmp_path / "other", *other, *resume), "grpo")
