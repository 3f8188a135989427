"""The RL run's memory-for-speed trades that the config leaves null, chosen before any engine is built by
:mod:`posttrain.core.memory_policy`; an explicit value is kept. vLLM's ``rollout.max_num_seqs`` and
``ref.engine.param_offload`` anywhere; on a CUDA device also each trained role's (the actor's, and the critic's
under PPO) ``enable_gradient_checkpointing`` and, with it, a null micro-batch token budget
(:func:`training_choices`), counting what else holds the device through that role's update: a vLLM rollout
that generates meanwhile, the reference, the other role's training state. Last, every role's null budget gets
the default (:func:`~posttrain.trainers.roles.fill_token_budget`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

import torch

from posttrain.core.memory_policy import (
    Choice,
    ModelShape,
    choose_gradient_checkpointing,
    choose_max_num_seqs,
    choose_ref_offload,
    choose_token_budget,
    rollout_reserve_bytes,
)

from ..roles import DEFAULT_MAX_TOKEN_LEN_PER_GPU, fill_token_budget
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
        for key, choice in training_choices(cfg, world, device, free, critic=critic).items():
            *path, name = key.split(".")
            setattr(functools.reduce(getattr, path, cfg), name, choice.value)
            lines.append(choice.line(key))
    for role in ("actor", "ref", "critic"):
        fill_token_budget(getattr(cfg, role).engine, cfg.rollout.prompt_length + cfg.rollout.response_length)
    if rank == 0:
        for line in lines:
            print(f"[posttrain] {line}", file=sys.stderr)
    return lines


def ref_offload_choice(cfg: Any, world: int, sequences: int) -> Any:
    if not torch.cuda.is_available():
        return Choice(False, "no CUDA device: the reference stays in host memory either way")
    free = torch.cuda.mem_get_info()[0]
    share = getattr(cfg.rollout, "gpu_memory_utilization", 0.5)
    tokens = sequences * (cfg.rollout.prompt_length + cfg.rollout.response_length)
    return choose_ref_offload(ModelShape.from_path(cfg.model.path), free, world, share, tokens)


def training_choices(
    cfg: Any, world: int, device: torch.device, free: int, *, critic: bool = False
) -> dict[str, Any]:
    """``{config key: Choice}`` for each trained role whose ``enable_gradient_checkpointing`` is null (the
    actor's ``model.``; the critic's ``critic.model.`` when ``critic``), ``free`` bytes being free on ``device``
    before the engines are built. A null ``<role>.engine.max_token_len_per_gpu`` is chosen first
    (:func:`~posttrain.core.memory_policy.choose_token_budget`: a smaller budget rather than recomputation),
    its forward-only passes keeping the default budget. What else holds the device through the role's update
    comes off first: a vLLM rollout's share when it generates on that device while the actor trains (a mode
    other than sync; on one H100 the 0.5B README work ran out of memory in one_step_off with recomputation
    chosen off from the whole free memory), the bf16 reference when it stays on the device, and the other
    role's training state (an engine alone would see none of them: it is built first, Adam's state comes at
    the first step)."""
    actor_shape = ModelShape.from_path(cfg.model.path)
    roles = {"actor": ("model", actor_shape)}
    if critic:
        shape = ModelShape.from_path(cfg.critic.model.path or cfg.model.path)
        roles["critic"] = ("critic.model", dataclasses.replace(shape, vocab=1))  # a value head, no logits
    shared = (_rollout_beside_actor(cfg, world, device, free) or 0) + (
        2 * actor_shape.params // max(world, 1) if _ref_on_device(cfg) else 0
    )
    longest = cfg.rollout.prompt_length + cfg.rollout.response_length
    choices = {}
    for role, (model_key, shape) in roles.items():
        engine = getattr(cfg, role).engine
        if functools.reduce(getattr, model_key.split("."), cfg).enable_gradient_checkpointing is not None:
            continue
        if not engine.use_dynamic_bsz:
            continue  # no token budget to estimate from: the engine recomputes
        beside = shared + sum(s.train_state_bytes(world) for r, (_, s) in roles.items() if r != role)
        tokens = engine.max_token_len_per_gpu
        if tokens is None:
            default = max(DEFAULT_MAX_TOKEN_LEN_PER_GPU, longest)
            budget = choose_token_budget(shape, default, longest, free, world, beside)
            choices[f"{role}.engine.max_token_len_per_gpu"] = budget
            tokens = budget.value
            if tokens < default and engine.infer_max_token_len_per_gpu is None:
                choices[f"{role}.engine.infer_max_token_len_per_gpu"] = Choice(
                    default, "forward-only passes keep no activations: the default budget"
                )
        choices[f"{model_key}.enable_gradient_checkpointing"] = choose_gradient_checkpointing(
            shape, tokens, free, world, beside=beside
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
