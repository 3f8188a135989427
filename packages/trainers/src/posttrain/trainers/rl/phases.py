"""The phases of one PPO / GRPO step, as functions over engines and packed batches.

Each phase reads what the previous ones wrote into the batch: ``old_log_probs`` (the actor before this step's
update), ``ref_log_probs`` (the reference policy), ``values`` (the critic, shifted so ``values[t]`` is the
value of the state that predicts token ``t``), ``advantages`` and ``returns``. All are per-token packed
fields, 0 off the response.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from posttrain.core import BaseEngine, PackedBatch

from ..algorithms import (
    AdvantageInputs,
    AlgorithmConfig,
    FixedKLController,
    RolloutCorrectionConfig,
    align_values,
    apply_kl_penalty,
    rollout_is_weights,
)
from ..algorithms.packed import masked_mean
from ..distributed import Replicas
from .batch import mini_batches, token_level_scores
from .router_replay import store_old_routing


def forward_outputs(
    engine: BaseEngine,
    batch: PackedBatch,
    replicas: Replicas,
    keys: tuple[str, ...],
    adapter_off: bool = False,
) -> dict[str, torch.Tensor]:
    """``model_output[key]`` (T, ...) of a forward-only pass for each of ``keys`` the engine returned, on the
    CPU, in batch order, on every rank (broadcast from the model-parallel source rank); floating outputs as
    float32, integer ones (``routed_experts``) unchanged."""
    ctx = engine.disable_adapter() if adapter_off else contextlib.nullcontext()
    with engine.eval_mode(), ctx, torch.no_grad():
        out = engine.infer_batch(batch)
    outputs = None
    if engine.is_mp_src_rank_with_outputs():
        if "model_output" not in out:
            raise RuntimeError(f"{type(engine).__name__} returned no model_output on its source rank")
        model_output = out["model_output"]
        outputs = {k: _host(model_output[k]) for k in keys if k in model_output}
    return replicas.broadcast(outputs)


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.float() if t.is_floating_point() else t


def compute_old_log_probs(
    actor: BaseEngine, batch: PackedBatch, replicas: Replicas, replay_mode: str = "disabled"
) -> dict[str, float]:
    """Actor log-probs (and entropy) before the update -> ``fields['old_log_probs']``; with router replay
    ``R2`` the experts this pass chose -> ``fields['routed_experts']`` (the update replays them)."""
    batch.meta["calculate_entropy"] = True
    try:
        out = forward_outputs(actor, batch, replicas, ("log_probs", "entropy", "routed_experts"))
    finally:
        batch.meta["calculate_entropy"] = False
    batch.fields["old_log_probs"] = out["log_probs"] * batch.loss_mask
    if replay_mode == "R2":
        store_old_routing(batch, out)
    metrics = {}
    if "entropy" in out:
        metrics["actor/entropy"] = float(masked_mean(out["entropy"], batch.loss_mask))
    rollout_lp = batch.fields.get("rollout_log_probs")
    if rollout_lp is not None:
        metrics.update(logprob_diff_metrics(rollout_lp, batch.fields["old_log_probs"], batch.loss_mask))
    return metrics


def behaviour_old_log_probs(batch: PackedBatch) -> None:
    """``rollout_correction.old_log_prob=behaviour``: the rollout's log-probs of its samples ->
    ``fields['old_log_probs']``, in place of the old-log-prob pass."""
    batch.fields["old_log_probs"] = batch.fields["rollout_log_probs"] * batch.loss_mask


def compute_rollout_correction(batch: PackedBatch, cfg: RolloutCorrectionConfig) -> dict[str, float]:
    """The behaviour -> proximal importance weights -> ``fields['is_weights']`` (the actor loss multiplies
    each token's policy loss by them); returns their statistics."""
    weights, metrics = rollout_is_weights(
        batch.fields["old_log_probs"],
        batch.fields["rollout_log_probs"],
        batch.loss_mask,
        batch.cu_seqlens,
        cfg,
    )
    batch.fields["is_weights"] = weights
    return metrics


def check_behaviour_old_log_probs(cfg: RolloutCorrectionConfig, rollout: Any, replay_mode: str) -> None:
    """Refuse ``old_log_prob=behaviour`` where the rollout's log-probs are not the trainer's policy at the
    sampling temperature (nucleus or top-k sampling renormalises over fewer tokens) or where the old-log-prob
    pass does more than log-probs (router replay R2 records its experts)."""
    if cfg.old_log_prob != "behaviour":
        return
    key = "algorithm.rollout_correction.old_log_prob=behaviour"
    if rollout.top_p < 1.0 or rollout.top_k != -1:
        raise ValueError(
            f"{key} with rollout.top_p={rollout.top_p}, rollout.top_k={rollout.top_k}: the rollout's "
            "log-probs are then of the truncated distribution, not of the policy; use old_log_prob=recompute "
            "or top_p=1, top_k=-1"
        )
    if replay_mode == "R2":
        raise ValueError(f"{key} skips the pass that records router replay R2's experts: use recompute or R3")


def logprob_diff_metrics(
    rollout_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout's log-probs of its own samples are from the actor's (same weights, other kernels):
    mean and max of ``|rollout - actor|`` over response tokens, and the KL(rollout || actor) per token by the
    k3 estimator ``E_rollout[r - 1 - log r]`` with ``r = p_actor / p_rollout`` (unbiased, >= 0 per sample)."""
    mask = mask.bool()
    if not mask.any():
        return {}
    delta = (actor_lp - rollout_lp).double()[mask]
    return {
        "rollout/logprob_diff/mean": float(delta.abs().mean()),
        "rollout/logprob_diff/max": float(delta.abs().max()),
        "rollout/logprob_diff/kl": float((delta.exp() - 1 - delta).mean()),
    }


def compute_ref_log_probs(ref: BaseEngine, batch: PackedBatch, replicas: Replicas, adapter_off: bool) -> None:
    """Reference log-probs -> ``fields['ref_log_probs']`` (a LoRA actor with its adapter off serves as
    ref)."""
    out = forward_outputs(ref, batch, replicas, ("log_probs",), adapter_off)
    batch.fields["ref_log_probs"] = out["log_probs"] * batch.loss_mask


def compute_values(critic: BaseEngine, batch: PackedBatch, replicas: Replicas) -> None:
    """Critic values aligned to the predicting state -> ``fields['values']``."""
    raw = forward_outputs(critic, batch, replicas, ("values",))["values"]
    batch.fields["values"] = align_values(raw, batch.cu_seqlens) * batch.loss_mask


def compute_advantages(
    batch: PackedBatch,
    cfg: AlgorithmConfig,
    kl_ctrl: FixedKLController | None,
    reward_baselines: torch.Tensor | None = None,
) -> dict[str, float]:
    """Scores (+ KL penalty) -> token rewards -> ``fields['advantages']`` and ``fields['returns']``."""
    metrics: dict[str, float] = {}
    rewards = token_level_scores(batch)
    if cfg.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(
            rewards,
            batch.fields["old_log_probs"],
            batch.fields["ref_log_probs"],
            batch.loss_mask,
            batch.cu_seqlens,
            kl_ctrl,
            cfg.kl_penalty,
        )
        metrics.update(kl_metrics)
    inputs = AdvantageInputs(
        token_level_rewards=rewards,
        response_mask=batch.loss_mask,
        cu_seqlens=batch.cu_seqlens,
        index=batch.seq_fields["uid"],
        values=batch.fields.get("values"),
        reward_baselines=reward_baselines,
    )
    adv, returns = cfg.build_estimator()(inputs)
    batch.fields["advantages"] = adv.float()
    batch.fields["returns"] = returns.float()
    metrics["critic/advantages/mean"] = float(masked_mean(adv, batch.loss_mask))
    metrics["critic/returns/mean"] = float(masked_mean(returns, batch.loss_mask))
    return metrics


PARTIAL_SUMS = ("actor/pg_loss", "critic/vf_loss")
"""Loss metrics each micro-batch reports as its share of the mini-batch loss: summed, not averaged."""


def update(
    engine: BaseEngine,
    batch: PackedBatch,
    loss_fn: Callable,
    *,
    prompts_per_mini: int,
    n: int,
    epochs: int,
    dp_size: int,
    replicas: Replicas,
    generator: torch.Generator | None,
    prefix: str,
) -> dict[str, float]:
    """``epochs`` passes of optimizer steps over mini-batches; metrics averaged over optimizer steps and
    broadcast from the model-parallel source rank (the only one the engine reports them on)."""
    per_step: dict[str, list[float]] = {}
    with engine.train_mode():
        for _ in range(epochs):
            for mb in mini_batches(batch, prompts_per_mini, n, dp_size, generator):
                out = engine.train_batch(mb, loss_fn)
                step_metrics = {f"{prefix}/loss": sum(float(x) for x in out.get("loss", []))}
                for key, value in out.get("metrics", {}).items():
                    values = [float(v) for v in (value if isinstance(value, list) else [value])]
                    name = key if "/" in key else f"{prefix}/{key}"
                    step_metrics[name] = sum(values) if name in PARTIAL_SUMS else sum(values) / len(values)
                for key, value in step_metrics.items():
                    per_step.setdefault(key, []).append(value)
    lr = engine.lr_scheduler_step()
    mine = (
        {k: sum(v) / len(v) for k, v in per_step.items() if v}
        if engine.is_mp_src_rank_with_outputs()
        else None
    )
    metrics: dict[str, Any] = replicas.broadcast(mine)
    metrics[f"{prefix}/lr"] = lr
    return metrics
