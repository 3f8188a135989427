"""The RL run's memory-for-speed trades that the config leaves null (``ref.engine.param_offload``, vLLM's
``rollout.max_num_seqs``), chosen before any engine is built by :mod:`posttrain.core.memory_policy`; an
explicit value is kept. A null ``enable_gradient_checkpointing`` of the actor (``model.``) or the critic
(``critic.model.``) is chosen here when something else holds memory on the device through that role's update:
a vLLM rollout that generates on the actor's GPU while the actor trains, or the other role's training state
(:func:`checkpointing_choices`); the role's engine chooses alone from the free memory otherwise (GRPO in sync
mode: vLLM sleeps through the update)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch

from posttrain.core.memory_policy import (
    ModelShape,
    choose_gradient_checkpointing,
    choose_max_num_seqs,
    choose_ref_offload,
    rollout_reserve_bytes,
)

from .modes import rollout_device


def choose_memory_trades(cfg: Any, world: int, rank: int = 0, *, critic: bool = False) -> list[str]:
    """Fill the null trades of ``cfg`` in place and return one ``key=value (chosen: why)`` line per choice
    (also printed on rank 0); ``critic``: the run trains a value model (GAE)."""
    lines = []
    sequences = max(cfg.data.train_batch_size // max(world, 1), 1) * cfg.rollout.n
    if getattr(cfg.rollout, "max_num_seqs", 0) is None:
        choice = choose_max_num_seqs(sequences)
        cfg.rollout.max_num_seqs = choice.value
        lines.append(choice.line("rollout.max_num_seqs"))
    if cfg.ref.engine.param_offload is None:
        choice = ref_offload_choice(cfg, world, sequences)
        cfg.ref.engine.param_offload = choice.value
        lines.append(choice.line("ref.engine.param_offload"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        free = torch.cuda.mem_get_info(device)[0]
        models = {"model": cfg.model, "critic.model": cfg.critic.model}
        for key, choice in checkpointing_choices(cfg, world, device, free, critic=critic).items():
            models[key].enable_gradient_checkpointing = choice.value
            lines.append(choice.line(f"{key}.enable_gradient_checkpointing"))
    if rank == 0:
        for line in lines:
            print(f"[posttrain] {line}", file=sys.stderr)
    return lines


def ref_offload_choice(cfg: Any, world: int, sequences: int) -> Any:
    from posttrain.core.memory_policy import Choice

    if not torch.cuda.is_available():
        return Choice(False, "no CUDA device: the reference stays in host memory either way")
    free = torch.cuda.mem_get_info()[0]
    share = getattr(cfg.rollout, "gpu_memory_utilization", 0.5)
    tokens = sequences * (cfg.rollout.prompt_length + cfg.rollout.response_length)
    return choose_ref_offload(ModelShape.from_path(cfg.model.path), free, world, share, tokens)


def checkpointing_choices(
    cfg: Any, world: int, device: torch.device, free: int, *, critic: bool = False
) -> dict[str, Any]:
    """``{"model" | "critic.model": Choice}`` for each trained role's null ``enable_gradient_checkpointing``
    (the critic's when ``critic``), ``free`` bytes being free on ``device`` before the engines are
    built. What the role's update shares the device with comes off first: a vLLM rollout's share when it
    generates on that device while the actor trains (a mode other than sync; on one H100 the 0.5B README work
    ran out of memory in one_step_off with recomputation chosen off from the whole free memory), the bf16
    reference when it stays on the device, and the other role's training state. Empty where the engine
    chooses alone: GRPO in sync mode or with the rollout on another device or without a memory share."""
    reserve = _rollout_beside_actor(cfg, world, device, free)
    if reserve is None and not critic:
        return {}
    actor_shape = ModelShape.from_path(cfg.model.path)
    roles = {"model": (cfg.model, cfg.actor.engine, actor_shape)}
    if critic:
        shape = ModelShape.from_path(cfg.critic.model.path or cfg.model.path)
        roles["critic.model"] = (cfg.critic.model, cfg.critic.engine, dataclasses.replace(shape, vocab=1))
    shared = (reserve or 0) + (2 * actor_shape.params // max(world, 1) if _ref_on_device(cfg) else 0)
    choices = {}
    for key, (model, engine, shape) in roles.items():
        if model.enable_gradient_checkpointing is not None or not engine.use_dynamic_bsz:
            continue
        others = sum(s.train_state_bytes(world) for k, (_, _, s) in roles.items() if k != key)
        choices[key] = choose_gradient_checkpointing(
            shape, engine.max_token_len_per_gpu, free, world, beside=shared + others
        )
    return choices


def _rollout_beside_actor(cfg: Any, world: int, device: torch.device, free: int) -> int | None:
    """What a vLLM rollout holds on ``device`` while the actor trains
    (:func:`~posttrain.core.memory_policy.rollout_reserve_bytes`), or None when it sleeps through the update
    (sync), runs on another device or has no memory share."""
    share = getattr(cfg.rollout, "gpu_memory_utilization", None)
    if cfg.trainer.mode == "sync" or share is None:
        return None
    if rollout_device(cfg.trainer.rollout_devices, device) != str(device):
        return None
    return rollout_reserve_bytes(
        ModelShape.from_path(cfg.model.path),
        free,
        world,
        share,
        ref_on_device=_ref_on_device(cfg),
        gib=getattr(cfg.rollout, "gpu_memory_gib", 0),
    )


def _ref_on_device(cfg: Any) -> bool:
    """Whether the run builds a reference engine whose bf16 weights stay on the device: a KL term needs one,
    LoRA's reference is the actor with its adapter off (no weights of its own), and an offloaded one holds
    host memory."""
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    return bool(use_ref and cfg.model.lora_rank == 0 and not cfg.ref.engine.param_offload)
