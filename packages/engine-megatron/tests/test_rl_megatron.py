"""The RL loop on the Megatron engine (CPU, gloo): two ranks with TP=2, and two with PP=2, reproduce the
one-process TP=1 GRPO run step for step (same rollouts and rewards; old and reference log-probs, losses and
grad norms equal up to float32 reduction order), and both ranks of the model-parallel group hold the same
batch. PPO with a critic (GAE) does the same at TP=2 (actor, reference and critic): the critic's values, the
advantages and returns made from them, and the critic's loss metrics equal the TP=1 run's.

Sampling is not forced greedy: the rollout's weights are the actor's, which agree across layouts to ~1e-7
after an update, so with the same seed the sampled tokens agree unless a draw lands that close to a
boundary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUTS = {
    "tp2": ["actor.engine.tensor_model_parallel_size=2", "ref.engine.tensor_model_parallel_size=2"],
    "pp2": ["actor.engine.pipeline_model_parallel_size=2", "ref.engine.pipeline_model_parallel_size=2"],
}
"""Two-rank GRPO layouts (one data-parallel rank each) and the overrides that make them."""

PPO = [
    "algorithm.adv_estimator=gae",
    "critic.ppo_mini_batch_size=2",
    "critic.engine.dtype=float32",
    "critic.engine.max_token_len_per_gpu=4096",
    "critic.optim.lr=1e-3",
]
"""PPO with a critic (GAE) on top of the GRPO defaults: the same actor and reference, plus a float32 critic
built from the actor's (tied) model, which the engine unties, with a fresh value head."""

PPO_LAYOUTS = {
    "ppo_tp2": [*LAYOUTS["tp2"], "critic.engine.tensor_model_parallel_size=2"],
    "ppo_pp2": [*LAYOUTS["pp2"], "critic.engine.pipeline_model_parallel_size=2"],
}
"""Two-rank PPO layouts: every role must use the actor's layout. PP=2 checks that the fresh value head is the
same at every layout (it is drawn from the engine seed, not from the default generator)."""

CLOSE = {
    "actor/loss": 1e-5,
    "actor/pg_loss": 1e-5,
    "actor/kl_loss": 1e-5,
    "actor/ppo_kl": 1e-5,
    "actor/entropy": 1e-5,
    "actor/grad_norm": 5e-5,  # TP=2 measured 4e-6 relative (sharded norm), PP=2 2e-8
}
"""Logged metrics that agree to float32 noise (relative tolerance, absolute below 1); rewards, response
lengths and token counts agree exactly."""

CRITIC_CLOSE = {
    "critic/loss": 1e-5,
    "critic/vf_loss": 1e-5,  # TP=2 measured 2e-6 relative
    "critic/vpred_mean": 1e-5,
    "critic/vf_clipfrac": 1e-5,  # a share of tokens: equal unless a prediction lands on the clip boundary
    "critic/grad_norm": 5e-5,  # TP=2 measured 3e-6 relative
    "critic/returns/mean": 1e-5,
    "critic/advantages/mean": 1e-5,
}
"""The critic's metrics in a PPO run, as :data:`CLOSE`."""

FIELDS_CLOSE = {
    "old_log_probs": 1e-5,
    "ref_log_probs": 1e-5,
    "values": 1e-5,  # TP=2 measured 3e-6 after one critic update
    "returns": 1e-5,
    "advantages": 2e-4,  # whitened: the values' noise over the batch's spread; TP=2 measured 6e-5
}
"""Per-token batch fields (absolute tolerance); ``values`` only in PPO runs."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_cpu import trainer_assets

    # "small" has 2 KV heads, so TP=2 divides them, and 4 layers for PP=2
    return trainer_assets(
        tmp_path_factory.mktemp("rl_megatron"), size="small", num_train=16, num_test=4, digits=1
    )


def _args(assets, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


RUNS = {"grpo": (LAYOUTS, "tp1", []), "ppo": (PPO_LAYOUTS, "ppo_tp1", PPO)}
"""Each family: its two-rank layouts, the name of its TP=1 reference run, the overrides of all its runs."""


@pytest.fixture(scope="module")
def results(assets, megatron_env):
    """{run name: (metrics rows, per-rank lists of recorded batches)} for every two-rank layout of
    :data:`RUNS` and their TP=1 references (one list of batches).

    One torchrun per parallel layout runs that layout's GRPO run and then its PPO run in the same two
    processes (``--then``), so each rank imports Megatron once; the launches go in the background while the
    references run here, GRPO then PPO, as in the workers."""
    from rl_megatron_worker import CPU_DEFAULTS, recording

    from posttrain.trainers.logging import read_metrics
    from posttrain.trainers.main_ppo import run

    worker = Path(__file__).with_name("rl_megatron_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for grpo_name, layout in LAYOUTS.items():
        ppo_name = f"ppo_{grpo_name}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += [str(worker)]
        for name, runs_layout, extra in ((grpo_name, layout, []), (ppo_name, PPO_LAYOUTS[ppo_name], PPO)):
            out = assets["root"] / name
            out.mkdir()
            cmd += [] if name == grpo_name else ["--then"]
            cmd += [
                "--record",
                str(out),
                *_args(assets, out, *extra, "trainer.n_gpus_per_node=2", *runs_layout),
            ]
        log_path = assets["root"] / f"log_{grpo_name}.txt"
        with open(log_path, "w") as log:  # a file, not a pipe: nobody reads until the references are done
            procs[grpo_name] = (
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT),
                log_path,
            )
    out: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: the same CPU kernels sample the same tokens
    try:
        for _, reference, extra in RUNS.values():
            store: list = []
            with recording(store):
                run([*CPU_DEFAULTS, *_args(assets, assets["root"] / reference, *extra)], "grpo")
            out[reference] = (read_metrics(assets["root"] / reference / "metrics.jsonl"), [store])
    finally:
        torch.set_num_threads(threads)
        for name, (proc, log_path) in procs.items():
            proc.wait(timeout=900)
            assert proc.returncode == 0, f"{name}:\n{log_path.read_text()[-6000:]}"
    for name in [*LAYOUTS, *PPO_LAYOUTS]:
        run_dir = assets["root"] / name
        batches = [torch.load(run_dir / f"rank{r}.pt") for r in (0, 1)]
        out[name] = (read_metrics(run_dir / "metrics.jsonl"), batches)
    return out


@pytest.mark.parametrize("layout", [*LAYOUTS, *PPO_LAYOUTS])
def test_both_ranks_of_a_model_parallel_group_hold_the_same_batch(results, layout):
    rank0, rank1 = results[layout][1]
    assert len(rank0) == len(rank1) == 2
    for step0, step1 in zip(rank0, rank1):
        assert step0.keys() == step1.keys()
        for key in step0:
            assert torch.equal(step0[key], step1[key]), key


@pytest.mark.parametrize("layout", [*LAYOUTS, *PPO_LAYOUTS])
def test_two_rank_layout_equals_one_process_run(results, layout):
    reference = RUNS["ppo" if layout in PPO_LAYOUTS else "grpo"][1]
    ref_rows, (ref_batches,) = results[reference]
    rows, (batches, _) = results[layout]
    ppo = layout in PPO_LAYOUTS
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2]
    for step, (ref, got) in enumerate(zip(ref_batches, batches), start=1):
        assert ref.keys() == got.keys(), step
        assert ("values" in ref) == ppo, step
        assert torch.equal(ref["input_ids"], got["input_ids"]), f"step {step}: different rollouts"
        assert torch.equal(ref["score"], got["score"]), step
        for key, tol in FIELDS_CLOSE.items():
            if key in ref:
                diff = float((ref[key] - got[key]).abs().max())
                assert diff < tol, (step, key, diff)
    close = {**CLOSE, **CRITIC_CLOSE} if ppo else CLOSE
    for ref, got in zip(ref_rows, rows):
        for key in ("reward/mean", "response_length/mean", "perf/tokens"):
            assert got[key] == ref[key], (ref["step"], key)
        for key, tol in close.items():
            diff = abs(got[key] - ref[key])
            assert diff < tol * max(1.0, abs(ref[key])), (ref["step"], key, got[key], ref[key])
