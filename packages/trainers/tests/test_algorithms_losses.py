"""Policy losses, KL estimators, aggregation, value loss and entropy against float64 per-token references, and
the invariance of the actor/critic losses to micro-batching and data parallelism."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_algorithms_advantages import random_layout

from posttrain.core.batch import LossContext, PackedBatch, make_micro_batches
from posttrain.trainers.algorithms import (
    LOSS_AGG_MODES,
    ActorLossConfig,
    CriticLossConfig,
    PolicyLossConfig,
    PolicyLossInputs,
    agg_loss,
    align_values,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
)

SCALE = 7.0


def agg_ref(per_tok: list[list[float]], masks: list[list[float]], mode: str) -> float:
    """The global aggregate written directly from the definitions (one process, whole batch)."""
    num_tokens = sum(sum(m) for m in masks)
    seq_sums = [sum(x * v for x, v in zip(s, m)) for s, m in zip(per_tok, masks)]
    if mode == "token-mean":
        return sum(seq_sums) / num_tokens
    if mode == "seq-mean-token-mean":
        return sum(s / max(sum(m), 1) for s, m in zip(seq_sums, masks)) / len(masks)
    out = sum(seq_sums) / len(masks)
    return out / SCALE if mode == "seq-mean-token-sum-norm" else out


def random_tokens(layout, seed: int, spread: float = 1.0):
    rng = random.Random(seed)
    old = [[rng.gauss(-1.5, 0.5) for _ in m] for m in layout.masks]
    new = [[o + rng.uniform(-spread, spread) for o in s] for s in old]
    adv = [[rng.gauss(0, 1) for _ in m] for m in layout.masks]
    return old, new, adv


def ctx_of(layout) -> LossContext:
    return LossContext(int(sum(sum(m) for m in layout.masks)), len(layout.masks), 1)


def vanilla_ref(o: float, n: float, a: float, cfg: ActorLossConfig) -> float:
    ratio = math.exp(max(min(n - o, 20.0), -20.0))
    clipped = max(-a * ratio, -a * min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high))
    return min(clipped, -a * cfg.clip_ratio_c) if a < 0 else clipped


def call_policy(mode, layout, old, new, adv, cfg):
    new_t = layout.packed(new).requires_grad_(True)
    inputs = PolicyLossInputs(
        old_log_prob=layout.packed(old),
        log_prob=new_t,
        advantages=layout.packed(adv),
        mask=layout.mask,
        cu_seqlens=layout.cu_seqlens,
        ctx=ctx_of(layout),
        loss_scale_factor=SCALE,
    )
    loss, metrics = get_policy_loss(mode)(inputs, cfg)
    loss.backward()
    return loss.detach(), metrics, layout.split(new_t.grad)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_ppo_with_dual_clip(mode):
    layout = random_layout(20)
    old, new, adv = random_tokens(layout, 21, spread=1.5)
    cfg = ActorLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    loss, metrics, _ = call_policy("vanilla", layout, old, new, adv, cfg)
    per_tok = [[vanilla_ref(o, n, a, cfg) for o, n, a in zip(*t)] for t in zip(old, new, adv)]
    assert abs(float(loss) - agg_ref(per_tok, layout.masks, mode)) < 1e-10
    flat = [(o, n, a) for s in zip(old, new, adv, layout.masks) for o, n, a, v in zip(*s) if v > 0]
    dual = sum(
        1
        for o, n, a in flat
        if a < 0 and max(-a * math.exp(n - o), -a * min(max(math.exp(n - o), 0.8), 1.28)) > -a * 3.0
    )
    assert dual > 0, "the test data should exercise the dual clip"
    assert abs(metrics["actor/pg_clipfrac_lower"] - dual / len(flat)) < 1e-12
    assert abs(metrics["actor/ppo_kl"] - sum(o - n for o, n, _ in flat) / len(flat)) < 1e-12


def test_clip_ratio_is_the_default_of_both_clips():
    """actor.clip_ratio sets both clips unless clip_ratio_low/high are given (verl's semantics)."""
    cfg = ActorLossConfig(clip_ratio=0.05)
    assert (cfg.clip_low, cfg.clip_high) == (0.05, 0.05)
    assert ActorLossConfig(clip_ratio=0.05, clip_ratio_high=0.3).clip_high == 0.3
    layout = random_layout(28)
    old, new, adv = random_tokens(layout, 29, spread=0.5)
    loss, metrics, _ = call_policy("vanilla", layout, old, new, adv, cfg)
    narrow = ActorLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05)
    per_tok = [[vanilla_ref(o, n, a, narrow) for o, n, a in zip(*t)] for t in zip(old, new, adv)]
    assert abs(float(loss) - agg_ref(per_tok, layout.masks, "token-mean")) < 1e-10
    _, default_metrics, _ = call_policy("vanilla", layout, old, new, adv, ActorLossConfig())
    assert metrics["actor/pg_clipfrac"] > default_metrics["actor/pg_clipfrac"] > 0


def test_gspo_value_and_gradient():
    layout = random_layout(22)
    old, new, adv = random_tokens(layout, 23, spread=0.3)
    cfg = ActorLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.1, loss_agg_mode="token-mean")
    loss, _, grad = call_policy("gspo", layout, old, new, adv, cfg)
    per_tok, want_grad = [], []
    num_seqs = len(layout.masks)
    for o, n, a, m in zip(old, new, adv, layout.masks):
        s = math.exp(min(sum((y - x) * v for x, y, v in zip(o, n, m)) / sum(m), 10.0))
        clipped = min(max(s, 1 - 0.05), 1 + 0.1)
        per_tok.append([max(-ai * s, -ai * clipped) for ai in a])
        # d/dlogp_t: the unclipped branch carries -A s (the token's own log-prob path), the clipped one
        # nothing
        want_grad.append(
            [(-ai * s if -ai * s >= -ai * clipped else 0.0) * v / sum(m) / num_seqs for ai, v in zip(a, m)]
        )
    assert abs(float(loss) - agg_ref(per_tok, layout.masks, "seq-mean-token-mean")) < 1e-10
    for g, w in zip(grad, want_grad):
        assert max(abs(x - y) for x, y in zip(g, w)) < 1e-10


def test_cispo_value_and_stop_gradient():
    layout = random_layout(24)
    old, new, adv = random_tokens(layout, 25, spread=0.6)
    cfg = ActorLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    loss, metrics, grad = call_policy("cispo", layout, old, new, adv, cfg)
    num_tokens = sum(sum(m) for m in layout.masks)
    per_tok, want_grad = [], []
    for o, n, a, m in zip(old, new, adv, layout.masks):
        w = [min(max(math.exp(y - x), 0.8), 1.2) for x, y in zip(o, n)]
        per_tok.append([-wi * ai * y for wi, ai, y in zip(w, a, n)])
        want_grad.append([-wi * ai * v / num_tokens for wi, ai, v in zip(w, a, m)])
    assert abs(float(loss) - agg_ref(per_tok, layout.masks, "token-mean")) < 1e-10
    for g, w in zip(grad, want_grad):
        assert max(abs(x - y) for x, y in zip(g, w)) < 1e-12
    assert 0 < metrics["actor/pg_clipfrac"] < 1


def kl_ref(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    x = max(min(ref - lp, 20.0), -20.0)
    return max(min(math.exp(x) - x - 1, 10.0), -10.0)


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    lp = [-1.0, -0.2, -3.0, -25.0, -0.5, -30.0]
    ref = [-1.3, -0.2, -0.1, -0.3, -2.5, -2.0]
    got = kl_penalty(torch.tensor(lp, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), kind)
    assert got.tolist() == pytest.approx([kl_ref(a, b, kind) for a, b in zip(lp, ref)], abs=1e-12)
    same = torch.tensor(lp, dtype=torch.float64)
    assert kl_penalty(same, same.clone(), kind).abs().max() == 0


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_straight_through_kl_has_k2_gradient(kind):
    lp = torch.tensor([-1.0, -0.2, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.3, -0.4, -0.1], dtype=torch.float64)
    out = kl_penalty(lp, ref, kind)
    assert out.tolist() == pytest.approx([kl_ref(a, b, kind[:-1]) for a, b in zip(lp.tolist(), ref.tolist())])
    out.sum().backward()
    assert lp.grad.tolist() == pytest.approx((lp - ref).tolist())


def test_value_loss_and_alignment():
    layout = random_layout(26)
    rng = random.Random(27)
    head = [[rng.gauss(0, 1) for _ in m] for m in layout.masks]
    old = [[rng.gauss(0, 1) for _ in m] for m in layout.masks]
    ret = [[rng.gauss(0, 1) for _ in m] for m in layout.masks]
    aligned = align_values(layout.packed(head), layout.cu_seqlens)
    assert layout.split(aligned) == [[0.0] + h[:-1] for h in head]
    micro = PackedBatch.from_sequences([[1] * len(m) for m in layout.masks], layout.masks)
    micro.fields.update(values=layout.packed(old), returns=layout.packed(ret))
    cfg = CriticLossConfig(cliprange_value=0.3)
    loss, metrics = cfg.build_loss()({"values": layout.packed(head)}, micro, ctx_of(layout))
    per_tok = []
    for h, o, r in zip(head, old, ret):
        v = [0.0] + h[:-1]
        per_tok.append(
            [
                max((vi - ri) ** 2, (oi + min(max(vi - oi, -0.3), 0.3) - ri) ** 2)
                for vi, oi, ri in zip(v, o, r)
            ]
        )
    assert abs(float(loss) - 0.5 * agg_ref(per_tok, layout.masks, "token-mean")) < 1e-10
    assert 0 < metrics["critic/vf_clipfrac"] < 1


def test_entropy_from_logits():
    logits = torch.randn(5, 11, dtype=torch.float64) * 3
    want = [-sum(p * math.log(p) for p in torch.softmax(row, -1).tolist()) for row in logits]
    assert entropy_from_logits(logits).tolist() == pytest.approx(want, abs=1e-5)


def actor_batch(layout, seed: int) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    old, new, adv = random_tokens(layout, seed, spread=0.5)
    rng = random.Random(seed + 1)
    ref = [[o + rng.uniform(-0.3, 0.3) for o in s] for s in old]
    batch = PackedBatch.from_sequences([[3] * len(m) for m in layout.masks], layout.masks)
    batch.fields.update(
        old_log_probs=layout.packed(old), advantages=layout.packed(adv), ref_log_probs=layout.packed(ref)
    )
    entropy = torch.tensor([rng.uniform(0, 3) for m in layout.masks for _ in m], dtype=torch.float64)
    return batch, layout.packed(new), entropy


def run_layout(
    loss_fn, batch, log_probs, entropy, parts_per_rank: list[list[list[int]]]
) -> tuple[float, torch.Tensor]:
    """Sum micro-batch losses per rank and average ranks, as grad accumulation + DP all-reduce do."""
    leaf = log_probs.clone().requires_grad_(True)
    seqs = [i for rank in parts_per_rank for part in rank for i in part]
    num_tokens = int(batch.select(seqs).loss_mask.sum())
    ctx = LossContext(num_tokens, len(seqs), len(parts_per_rank))
    total = 0.0
    cu = batch.cu_seqlens.tolist()
    for rank in parts_per_rank:
        for part in rank:
            idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in part])
            loss, _ = loss_fn({"log_probs": leaf[idx], "entropy": entropy[idx]}, batch.select(part), ctx)
            (loss / len(parts_per_rank)).backward()
            total += float(loss.detach()) / len(parts_per_rank)
    return total, leaf.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gspo"])
def test_actor_loss_is_invariant_to_micro_batching_and_dp(mode, loss_mode):
    layout = random_layout(30, num_prompts=5)
    batch, log_probs, entropy = actor_batch(layout, 31)
    cfg = ActorLossConfig(
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    loss_fn = cfg.build_loss(loss_scale_factor=SCALE)
    everything = list(range(batch.num_seqs))
    whole, whole_grad = run_layout(loss_fn, batch, log_probs, entropy, [[everything]])
    by_count = make_micro_batches(batch, max_tokens=None, micro_batch_size=3, use_dynamic_bsz=False)
    by_tokens = make_micro_batches(batch, max_tokens=20, micro_batch_size=None, use_dynamic_bsz=True)
    two_ranks = [[everything[:4], everything[4:7]], [everything[7:9], everything[9:]]]
    for parts in ([by_count], [by_tokens], two_ranks):
        total, grad = run_layout(loss_fn, batch, log_probs, entropy, parts)
        assert abs(total - whole) < 1e-12
        torch.testing.assert_close(grad, whole_grad, rtol=0, atol=1e-14)
    assert len(by_count) > 1 and len(by_tokens) > 1


def test_actor_loss_terms_and_kl_zero_when_actor_is_reference():
    layout = random_layout(32)
    batch, log_probs, entropy = actor_batch(layout, 33)
    batch.fields["ref_log_probs"] = log_probs.clone()
    base = ActorLossConfig()
    full = ActorLossConfig(entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.5)
    ctx = ctx_of(layout)
    out = {"log_probs": log_probs, "entropy": entropy}
    pg, _ = base.build_loss()(out, batch, ctx)
    total, metrics = full.build_loss()(out, batch, ctx)
    ent = agg_ref(layout.split(entropy), layout.masks, "token-mean")
    assert metrics["actor/kl_loss"] == 0.0
    assert abs(float(total) - (float(pg) - 0.05 * ent)) < 1e-12
    with pytest.raises(ValueError, match="calculate_entropy"):
        full.build_loss()({"log_probs": log_probs}, batch, ctx)
    del batch.fields["ref_log_probs"]
    with pytest.raises(ValueError, match="ref_log_probs"):
        full.build_loss()(out, batch, ctx)


def test_agg_and_config_errors():
    layout = random_layout(34)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(layout.mask, layout.mask, layout.cu_seqlens, "seq-mean-token-sum-norm", ctx_of(layout))
    with pytest.raises(ValueError, match="token-mean"):
        ActorLossConfig(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ActorLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="cispo"):
        PolicyLossConfig(loss_mode="ppo")
