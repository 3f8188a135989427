"""Rollout correction (TIS, MIS, token and sequence level, decoupled PPO) against float64 references written
from the formulas per token with ``math``, and its config's refusals."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_algorithms_advantages import random_layout
from test_algorithms_losses import SCALE, actor_batch, agg_ref, ctx_of, vanilla_ref

from posttrain.trainers.algorithms import (
    ActorLossConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    rollout_is_weights,
)


def behaviour_of(old: list[list[float]], seed: int, spread: float = 1.0) -> list[list[float]]:
    """Behaviour log-probs spread around the proximal ones (wide enough that the caps act)."""
    rng = random.Random(seed)
    return [[o + rng.uniform(-spread, spread) for o in s] for s in old]


def weights_ref(
    old: list[list[float]], mu: list[list[float]], masks: list[list[float]], cfg: RolloutCorrectionConfig
) -> tuple[list[list[float]], int, int]:
    """(per-token weights, tokens the cap acted on, response tokens), written from the module docstring."""
    out, hit, count = [], 0, 0
    for o, b, m in zip(old, mu, masks):
        if cfg.level == "sequence":
            log_rho = sum((x - y) * v for x, y, v in zip(o, b, m)) / sum(m)
            rhos = [math.exp(log_rho)] * len(m)
        else:
            rhos = [math.exp(max(min(x - y, 20.0), -20.0)) for x, y in zip(o, b)]
        row = []
        for rho, v in zip(rhos, m):
            if cfg.mode == "tis":
                w, acted = min(rho, cfg.cap), rho > cfg.cap
            else:
                acted = rho > cfg.cap or rho < cfg.cap_low
                w = 0.0 if acted else rho
            row.append(w * v)
            hit += int(acted and v > 0)
            count += int(v > 0)
        out.append(row)
    return out, hit, count


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_and_their_statistics(mode, level):
    layout = random_layout(40, num_prompts=6)
    rng = random.Random(41)
    old = [[rng.gauss(-1.5, 0.5) for _ in m] for m in layout.masks]
    mu = behaviour_of(old, 42, spread=1.2)
    cfg = RolloutCorrectionConfig(mode=mode, level=level, cap=1.5, cap_low=0.5 if mode == "mis" else 0.0)
    got, metrics = rollout_is_weights(
        layout.packed(old), layout.packed(mu), layout.mask, layout.cu_seqlens, cfg
    )
    want, hit, count = weights_ref(old, mu, layout.masks, cfg)
    torch.testing.assert_close(got, layout.packed(want), rtol=0, atol=1e-12)
    assert 0 < hit < count, "the data should put some tokens past the cap and some within it"
    share = "clipped_frac" if mode == "tis" else "masked_frac"
    assert metrics[f"rollout/is_weight/{share}"] == pytest.approx(hit / count, abs=1e-12)
    flat = [w for row, m in zip(want, layout.masks) for w, v in zip(row, m) if v > 0]
    assert metrics["rollout/is_weight/mean"] == pytest.approx(sum(flat) / count, abs=1e-12)


def test_sequence_level_is_the_geometric_mean_of_token_ratios():
    """One sequence, two response tokens with ratios 4 and 1/4: the sequence ratio is 1, so nothing is
    truncated, while at token level the first token is."""
    old = torch.tensor([0.0, math.log(4.0), math.log(0.25)], dtype=torch.float64)
    mu = torch.zeros(3, dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    seq, _ = rollout_is_weights(old, mu, mask, cu, RolloutCorrectionConfig(mode="tis", level="sequence"))
    tok, _ = rollout_is_weights(old, mu, mask, cu, RolloutCorrectionConfig(mode="tis", level="token"))
    torch.testing.assert_close(seq, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(tok, torch.tensor([0.0, 2.0, 0.25], dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo"])
def test_actor_loss_multiplies_each_tokens_policy_loss_by_the_weight(loss_mode):
    """The weighted loss equals the unweighted one with the weights folded into the per-token advantages
    (every policy loss is linear in A at fixed ratios); for vanilla also the float64 reference itself."""
    layout = random_layout(44)
    batch, log_probs, _ = actor_batch(layout, 45)
    rng = random.Random(46)
    weights = [[rng.choice([0.0, 0.5, 1.0, 1.7]) for _ in m] for m in layout.masks]
    cfg = ActorLossConfig(clip_ratio_c=3.0, policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    loss_fn = cfg.build_loss(loss_scale_factor=SCALE)
    out, ctx = {"log_probs": log_probs}, ctx_of(layout)
    plain, _ = loss_fn(out, batch, ctx)
    batch.fields["is_weights"] = layout.packed(weights)
    weighted, _ = loss_fn(out, batch, ctx)
    assert abs(float(weighted) - float(plain)) > 1e-3, "the weights should change the loss"
    if loss_mode == "vanilla":
        old, new = layout.split(batch.fields["old_log_probs"]), layout.split(log_probs)
        adv = layout.split(batch.fields["advantages"])
        per_tok = [
            [w * vanilla_ref(o, n, a, cfg) for o, n, a, w in zip(*t)] for t in zip(old, new, adv, weights)
        ]
        assert abs(float(weighted) - agg_ref(per_tok, layout.masks, "token-mean")) < 1e-12
    if loss_mode == "cispo":  # linear in A: the weight can be folded into the advantages
        del batch.fields["is_weights"]
        batch.fields["advantages"] = batch.fields["advantages"] * layout.packed(weights)
        folded, _ = loss_fn(out, batch, ctx)
        assert abs(float(weighted) - float(folded)) < 1e-12


def test_decoupled_ppo_is_areals_loss():
    """AReaL's ``ppo_actor_loss_fn`` written out: ratio against the proximal policy, clipped; the behaviour
    weight ``exp(prox - behav)`` masked above ``behav_imp_weight_cap``; token mean over the loss mask."""
    layout = random_layout(50, num_prompts=5)
    rng = random.Random(51)
    prox = [[rng.gauss(-1.5, 0.5) for _ in m] for m in layout.masks]
    new = [[p + rng.uniform(-0.4, 0.4) for p in s] for s in prox]
    behav = behaviour_of(prox, 52, spread=1.0)
    adv = [[rng.gauss(0, 1) for _ in m] for m in layout.masks]
    cap, eps = 1.6, 0.2
    total, count = 0.0, 0
    for p, n, b, a, m in zip(prox, new, behav, adv, layout.masks):
        for pt, nt, bt, at, v in zip(p, n, b, a, m):
            if v == 0:
                continue
            r = math.exp(nt - pt)
            pg = max(-at * r, -at * min(max(r, 1 - eps), 1 + eps))
            w = math.exp(pt - bt)
            total += (w if w <= cap else 0.0) * pg
            count += 1
    correction = RolloutCorrectionConfig(mode="mis", level="token", cap=cap)
    weights, _ = rollout_is_weights(
        layout.packed(prox), layout.packed(behav), layout.mask, layout.cu_seqlens, correction
    )
    from posttrain.core.batch import PackedBatch

    batch = PackedBatch.from_sequences([[3] * len(m) for m in layout.masks], layout.masks)
    batch.fields.update(old_log_probs=layout.packed(prox), advantages=layout.packed(adv), is_weights=weights)
    loss_fn = ActorLossConfig(clip_ratio=eps, clip_ratio_c=1e9).build_loss()
    loss, _ = loss_fn({"log_probs": layout.packed(new)}, batch, ctx_of(layout))
    assert abs(float(loss) - total / count) < 1e-12


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "is"}, r"mode='is': choose none or one of \['mis', 'tis'\]"),
        ({"mode": "tis", "level": "seq"}, r"level='seq'"),
        ({"mode": "tis", "cap": 0.9}, r"cap=0.9 must be > 1"),
        ({"mode": "tis", "cap_low": 0.5}, r"cap_low=0.5 only applies to mode=mis"),
        ({"mode": "mis", "old_log_prob": "behaviour"}, r"use old_log_prob=recompute or mode=none"),
        ({"old_log_prob": "rollout"}, r"old_log_prob='rollout'"),
    ],
)
def test_config_refusals_name_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**kwargs)


def test_behaviour_old_log_probs_refused_with_nucleus_sampling_and_r2():
    from posttrain.core.rollout import RolloutConfig
    from posttrain.trainers.rl.phases import check_behaviour_old_log_probs

    cfg = RolloutCorrectionConfig(old_log_prob="behaviour")
    check_behaviour_old_log_probs(cfg, RolloutConfig(), "disabled")
    with pytest.raises(ValueError, match=r"top_p=0.9.*use old_log_prob=recompute"):
        check_behaviour_old_log_probs(cfg, RolloutConfig(top_p=0.9), "disabled")
    with pytest.raises(ValueError, match="router replay R2"):
        check_behaviour_old_log_probs(cfg, RolloutConfig(), "R2")
