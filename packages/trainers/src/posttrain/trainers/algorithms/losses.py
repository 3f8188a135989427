"""The actor and critic loss functions handed to ``engine.forward_backward_batch``, plus entropy.

Actor (verl ``ppo_loss``): ``policy_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl(logp, ref))``,
every term aggregated with ``actor.loss_agg_mode`` and the step's global counts. It reads
``model_output["log_probs"]`` (and ``["entropy"]`` when ``entropy_coeff != 0`` or when the engine returns it)
and the micro-batch fields ``old_log_probs``, ``advantages``, ``is_weights`` when the rollout correction made
them, and, with ``use_kl_loss``, ``ref_log_probs``.

Critic (verl ``compute_value_loss``): ``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``
with ``c = cliprange_value``; it reads ``model_output["values"]`` (value-head outputs, aligned onto the next
token with
:func:`~.packed.align_values` unless ``align_model_values=False``) and the fields ``values`` (the aligned
values the advantages were computed with) and ``returns``.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.batch import LossContext, PackedBatch

from .agg import LossTokens
from .config import CriticLossConfig
from .kl import kl_penalty
from .packed import align_values
from .policy import ActorLossConfig, PolicyLossInputs, get_policy_loss

__all__ = ["CriticLossConfig"]  # re-exported: its old import path


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _field(micro: PackedBatch, name: str, why: str) -> torch.Tensor:
    if name not in micro.fields:
        raise ValueError(
            f"the {why} needs batch.fields[{name!r}] (have {sorted(micro.fields)}): compute it before "
            "the update"
        )
    return micro.fields[name]


class ActorLoss:
    """The actor's ``loss_fn(model_output, micro, ctx)`` (built by :meth:`.config.ActorLossConfig.build`);
    ``loss_scale_factor`` fills a None in ``cfg``."""

    def __init__(self, cfg: ActorLossConfig, loss_scale_factor: float | None = None) -> None:
        self.cfg = cfg
        self.policy_fn = get_policy_loss(cfg.policy_loss.loss_mode)
        self.scale = cfg.loss_scale_factor if cfg.loss_scale_factor is not None else loss_scale_factor

    def __call__(
        self, model_output: dict[str, torch.Tensor], micro: PackedBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        log_prob, mask, cu = model_output["log_probs"], micro.loss_mask, micro.cu_seqlens
        old = _field(micro, "old_log_probs", "policy loss")
        adv = _field(micro, "advantages", "policy loss")
        inputs = PolicyLossInputs(
            old_log_prob=old,
            log_prob=log_prob,
            advantages=adv,
            is_weights=micro.fields.get("is_weights"),
            mask=mask,
            cu_seqlens=cu,
            ctx=ctx,
            loss_scale_factor=self.scale,
        )
        loss, metrics = self.policy_fn(inputs, cfg)
        metrics["actor/pg_loss"] = float(loss.detach())
        entropy = model_output.get("entropy")
        if cfg.entropy_coeff != 0 and entropy is None:
            raise ValueError(
                f"actor.entropy_coeff={cfg.entropy_coeff} needs the engine's entropy: set "
                "batch.meta['calculate_entropy']=True"
            )
        if entropy is not None:
            metrics["actor/entropy"] = float(inputs.mean(entropy.detach()))
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * inputs.agg(entropy, cfg.loss_agg_mode)
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, _field(micro, "ref_log_probs", "KL loss"), cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * inputs.agg(kld, cfg.loss_agg_mode)
            metrics["actor/kl_loss"] = float(inputs.mean(kld.detach()))
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return loss, metrics


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    tokens: LossTokens,
    cfg: CriticLossConfig,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped value loss (PPO2 baselines / TRL; verl ``compute_value_loss``) of the (T,) value predictions,
    returns and the values the advantages used, see the module docstring."""
    clipped = old_values + torch.clamp(vpreds - old_values, -cfg.cliprange_value, cfg.cliprange_value)
    loss1, loss2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * tokens.agg(torch.maximum(loss1, loss2), cfg.loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": float(loss),
            "critic/vf_clipfrac": float(tokens.mean((loss2 > loss1).float())),
            "critic/vpred_mean": float(tokens.mean(vpreds)),
        }
    return loss, metrics


class CriticLoss:
    """The critic's ``loss_fn(model_output, micro, ctx)`` (built by :meth:`.config.CriticLossConfig.build`);
    with ``align_model_values`` the value-head outputs are aligned onto the next token first."""

    def __init__(
        self, cfg: CriticLossConfig, loss_scale_factor: float | None = None, align_model_values: bool = True
    ) -> None:
        self.cfg, self.loss_scale_factor, self.align_model_values = cfg, loss_scale_factor, align_model_values

    def __call__(
        self, model_output: dict[str, torch.Tensor], micro: PackedBatch, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        vpreds = model_output["values"]
        if self.align_model_values:
            vpreds = align_values(vpreds, micro.cu_seqlens)
        old = _field(micro, "values", "value loss")
        returns = _field(micro, "returns", "value loss")
        tokens = LossTokens(
            mask=micro.loss_mask,
            cu_seqlens=micro.cu_seqlens,
            ctx=ctx,
            loss_scale_factor=self.loss_scale_factor,
        )
        return value_loss(vpreds, returns, old, tokens, self.cfg)
