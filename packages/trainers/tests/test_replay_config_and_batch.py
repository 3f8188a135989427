"""Router replay in the RL loop without an engine: which configs may use it, and how the rollout's routing
reaches the packed batch and its mini-batches. The end-to-end runs (Megatron actor, R2 and R3) are in
``packages/engine-megatron/tests/test_rl_router_replay.py``."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.rollout import RolloutSample
from posttrain.trainers.config import load_config
from posttrain.trainers.rl.batch import build_batch, mini_batches
from posttrain.trainers.rl.router_replay import replay_mode


def test_replay_mode_asks_the_engine_class_and_names_the_fix():
    """Replay is allowed when the actor's engine class declares ``supports_router_replay`` (read through the
    config class, nothing built); the megatron engine's own declaration is tested in engine-megatron."""
    fsdp_cls = load_config([]).actor.engine.engine_class("language_model")

    class Replaying(fsdp_cls):
        supports_router_replay = True

    def mode_of(overrides: list[str], engine_cls: type) -> str:
        cfg = load_config(overrides)
        return replay_mode(cfg.actor.engine.router_replay.mode, engine_cls, cfg.rollout.return_routed_experts)

    assert mode_of([], fsdp_cls) == "disabled"
    with pytest.raises(
        ValueError, match="R2: the actor's engine FSDPLanguageModelEngine does not replay routing"
    ):
        mode_of(["actor.engine.router_replay.mode=R2"], fsdp_cls)
    r3 = ["actor.engine.router_replay.mode=R3"]
    with pytest.raises(ValueError, match="set rollout.return_routed_experts=true"):
        mode_of(r3, Replaying)
    assert mode_of([*r3, "rollout.return_routed_experts=true"], Replaying) == "R3"
    assert mode_of(["actor.engine.router_replay.mode=R2"], Replaying) == "R2"


def _sample(index: int, prompt_len: int, response_len: int, routed: bool) -> RolloutSample:
    n = prompt_len + response_len
    return RolloutSample(
        prompt_index=index,
        prompt_ids=list(range(prompt_len)),
        response_ids=list(range(response_len)),
        log_probs=torch.zeros(response_len),
        routed_experts=torch.arange(n * 2 * 2, dtype=torch.int32).view(n, 2, 2) + 1000 * index
        if routed
        else None,
    )


def test_rollout_routing_follows_its_tokens_into_mini_batches():
    samples = [_sample(i, 3 + i, 2 + i, routed=True) for i in range(4)]
    batch = build_batch(samples, [0.0] * 4, [0, 0, 1, 1], temperature=1.0)
    assert batch.fields["routed_experts"].shape == (batch.num_tokens, 2, 2)
    gen = torch.Generator().manual_seed(0)
    for mb in mini_batches(batch, num_prompts_per_mini=1, n=2, dp_size=1, generator=gen):
        for seq in mb.split_tokens(mb.fields["routed_experts"]):
            index = int(seq[0, 0, 0]) // 1000
            assert torch.equal(seq, samples[index].routed_experts)


def test_partly_routed_rollout_is_refused():
    samples = [_sample(0, 3, 2, routed=True), _sample(1, 3, 2, routed=False)]
    with pytest.raises(ValueError, match="return_routed_experts=true"):
        build_batch(samples, [0.0, 0.0], [0, 1], temperature=1.0)
    assert "routed_experts" not in build_batch(samples[1:], [0.0], [0], 1.0).fields
