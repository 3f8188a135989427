"""MoE router replay in the RL loop (``actor.engine.router_replay.mode``).

Without replay the update re-routes every token with the weights it is training, so an MoE policy's experts
can differ between the pass that made the old log-probs (or the rollout that sampled) and the update, which
adds noise to the importance ratio. Replay makes the update use recorded experts, carried per token in
``batch.fields["routed_experts"]`` (T, MoE layers, k), which follows its tokens into every mini- and
micro-batch.

- ``R2``: the old-log-prob pass (forward-only) records the experts the actor chose; :func:`store_old_routing`
  puts them into the batch, and each update mini-batch replays them.
- ``R3``: the rollout records them (``rollout.return_routed_experts=true``), :func:`~.batch.build_batch` puts
  them into the batch, and the old-log-prob pass and the updates replay them. The rollout never fed the last
  token of a sequence to its model; its row is -1 and the engine gives it fixed experts, which changes no
  log-prob (see ``posttrain.megatron.router_replay``).

An engine declares replay with the class attribute ``supports_router_replay`` (the megatron engine does), read
through the engine registry before anything is built; the reference policy and the critic route as their own
``engine.router_replay`` says (default: no replay).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core import BaseEngine, PackedBatch

FIELD = "routed_experts"


def replay_mode(mode: str, engine_cls: type[BaseEngine], return_routed_experts: bool) -> str:
    """The actor's ``router_replay.mode`` (``disabled``, ``R2`` or ``R3``) once the run is known to support
    it:
    ``engine_cls`` (the actor's engine class) declares ``supports_router_replay``, and R3 has a rollout that
    records the experts (``rollout.return_routed_experts``); a ValueError naming the fix otherwise."""
    if mode == "disabled":
        return mode
    if not engine_cls.supports_router_replay:
        raise ValueError(
            f"actor.engine.router_replay.mode={mode}: the actor's engine {engine_cls.__name__} does not "
            "replay routing (supports_router_replay is False); use an engine that does "
            "(model_engine=megatron) or set router_replay.mode=disabled"
        )
    if mode == "R3" and not return_routed_experts:
        raise ValueError(
            "actor.engine.router_replay.mode=R3 replays the rollout's routing: set "
            "rollout.return_routed_experts=true (the hf rollout records it)"
        )
    return mode


def store_old_routing(batch: PackedBatch, outputs: dict[str, torch.Tensor]) -> None:
    """R2: the experts the old-log-prob pass recorded -> ``batch.fields['routed_experts']``."""
    if FIELD not in outputs:
        raise RuntimeError(
            "actor.engine.router_replay.mode=R2 but the actor's log-prob pass returned no routed_experts"
        )
    batch.fields[FIELD] = outputs[FIELD].to(torch.int32)


def rollout_routing(samples: Any) -> torch.Tensor | None:
    """(T, layers, k) int32: the samples' ``routed_experts`` packed like their tokens, or None when the
    rollout recorded none; a ValueError when only some samples carry them."""
    routed = [s.routed_experts for s in samples]
    if all(r is None for r in routed):
        return None
    if any(r is None for r in routed):
        raise ValueError(
            "some rollout samples carry routed_experts and some do not: the rollout backend must record "
            "every sample's routing (rollout.return_routed_experts=true with rollout.name=hf)"
        )
    return torch.cat([torch.as_tensor(r, dtype=torch.int32) for r in routed])


def require_rollout_routing(batch: PackedBatch, rollout_name: str) -> None:
    """R3: ValueError unless the rollout's routing reached the batch."""
    if FIELD not in batch.fields:
        raise ValueError(
            f"actor.engine.router_replay.mode=R3 but rollout.name={rollout_name} returned no routed_experts: "
            "use rollout.name=hf (it records them) or router_replay.mode=R2"
        )
