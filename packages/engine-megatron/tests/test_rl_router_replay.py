"""GRPO on a tiny Qwen3-MoE with the Megatron actor (CPU, one process) and router replay R2 and R3.

Every actor update micro-batch carries ``routed_experts`` and the routers use exactly those experts (read by
forward hooks on Megatron-Core's routers), including after the first optimizer step has moved the router
weights. Before any update the replayed log-probs equal the old log-probs bitwise (one sequence per
micro-batch in both passes, so the computations are the same). R2's routing is the old-log-prob pass's record;
R3's is the rollout's, and with it the old log-probs equal the rollout's own to float32 noise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from posttrain.core.testing import TINY_QWEN3_MOE

pytestmark = pytest.mark.slow

REPLAY = [
    "actor.use_kl_loss=false",  # no reference engine: nothing here depends on it
    "actor.engine.use_dynamic_bsz=false",
    "actor.engine.micro_batch_size_per_gpu=1",
    "trainer.total_training_steps=2",
]
"""On top of ``rl_megatron_worker.CPU_DEFAULTS`` (4 prompts x 4 responses, 2 actor mini-batches per step)."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from make_tiny_moe import make_tiny_moe

    from posttrain.trainers.data.convert import write_parquet
    from posttrain.trainers.data.synthetic import arithmetic_rows
    from posttrain.trainers.model_init import init_model

    root = tmp_path_factory.mktemp("rl_moe")
    dense = init_model(root / "dense", size="tiny", seed=0)
    return {
        "root": root,
        "model": make_tiny_moe(dense, root / "moe"),
        "train": write_parquet(arithmetic_rows(16, 4, digits=1, seed=0)["train"], root / "train.parquet"),
    }


@contextlib.contextmanager
def probe_updates(store: list[dict]) -> Iterator[None]:
    """Wrap ``phases.update`` of the actor: per update micro-batch, file its step, old and new log-probs, loss
    mask, ``routed_experts`` field and the (T, layers, experts) maps the routers used."""
    from megatron.core.transformer.moe.router import TopKRouter

    from posttrain.trainers.rl import phases

    original, calls = phases.update, []

    def update(engine, batch, loss_fn, **kwargs):
        if kwargs["prefix"] != "actor":
            return original(engine, batch, loss_fn, **kwargs)
        calls.append(None)
        routers = [m for m in engine.chunks[0].modules() if isinstance(m, TopKRouter)]
        maps: list[list[torch.Tensor]] = [[] for _ in routers]
        hooks = [r.register_forward_hook(_filer(maps[i])) for i, r in enumerate(routers)]

        def capture(out, micro, ctx):
            store.append(
                {
                    "step": len(calls),
                    "old": micro.fields["old_log_probs"].clone(),
                    "new": out["log_probs"].detach().clone(),
                    "mask": micro.loss_mask.clone(),
                    "routed": micro.fields.get("routed_experts"),
                    "used": torch.stack([m[-1][: micro.num_tokens] for m in maps], dim=1),
                }
            )
            return loss_fn(out, micro, ctx)

        try:
            return original(engine, batch, capture, **kwargs)
        finally:
            for h in hooks:
                h.remove()

    phases.update = update
    try:
        yield
    finally:
        phases.update = original


def _filer(into: list[torch.Tensor]):
    return lambda module, args, out: into.append(out[1].detach().clone())


def as_maps(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T, layers, k) expert ids -> (T, layers, experts) bool; -1 rows -> experts 0..k-1 (the engine's
    fill)."""
    idx = torch.where(indices < 0, torch.arange(indices.shape[-1]), indices.long())
    return torch.zeros(*indices.shape[:2], num_experts, dtype=torch.bool).scatter_(2, idx, True)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_grpo_updates_replay_routing(megatron_env, assets, mode):
    from rl_megatron_worker import CPU_DEFAULTS

    from posttrain.trainers.logging import read_metrics
    from posttrain.trainers.main_ppo import run

    run_dir = assets["root"] / mode
    args = [
        *CPU_DEFAULTS,
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        f"trainer.default_local_dir={run_dir}",
        *REPLAY,
        f"actor.engine.router_replay.mode={mode}",
    ]
    if mode == "R3":
        args.append("rollout.return_routed_experts=true")
    store: list[dict] = []
    with probe_updates(store):
        run(args, "grpo")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert len(store) == 2 * 16  # 2 steps x 16 sequences, one per micro-batch
    for mb in store:
        assert mb["routed"] is not None
        if mode == "R3":
            assert (mb["routed"][-1] == -1).all()  # the rollout never fed the last token
        assert torch.equal(mb["used"], as_maps(mb["routed"], TINY_QWEN3_MOE["num_experts"]))
    first_mini_batch = store[:8]  # step 1, before the first optimizer step
    for mb in first_mini_batch:
        assert torch.equal(mb["new"] * mb["mask"], mb["old"])
    if mode == "R3":
        assert rows[0]["rollout/logprob_diff/max"] < 1e-4
