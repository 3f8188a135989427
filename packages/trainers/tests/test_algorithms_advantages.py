"""Advantage estimators and KL-in-reward against float64 references written per sequence from the formulas."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from posttrain.trainers.algorithms import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    AdvantageInputs,
    AlgorithmConfig,
    FixedKLController,
    KLControlConfig,
    adv_estimator_traits,
    apply_kl_penalty,
    get_adv_estimator,
    scores_to_token_rewards,
)


@dataclass
class Layout:
    """A random packed batch: prompt + response per sequence, groups of ``n``; python lists for references."""

    masks: list[list[float]]
    groups: list[int]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor(
            [0] + [sum(len(m) for m in self.masks[: i + 1]) for i in range(len(self.masks))],
            dtype=torch.int32,
        )

    @property
    def mask(self) -> torch.Tensor:
        return torch.tensor([v for m in self.masks for v in m], dtype=torch.float64)

    def packed(self, per_seq: list[list[float]]) -> torch.Tensor:
        return torch.tensor([v for s in per_seq for v in s], dtype=torch.float64)

    def split(self, values: torch.Tensor) -> list[list[float]]:
        out, start = [], 0
        for m in self.masks:
            out.append(values[start : start + len(m)].tolist())
            start += len(m)
        return out


def random_layout(seed: int, num_prompts: int = 4, n: int = 3, hole: bool = True) -> Layout:
    """Sequences of 1-4 prompt tokens and 1-6 response tokens; with ``hole`` one response has a masked
    observation token in the middle (multi-turn), and one group has a single sample."""
    rng = random.Random(seed)
    masks, groups = [], []
    for p in range(num_prompts):
        for _ in range(1 if p == num_prompts - 1 else n):
            masks.append([0.0] * rng.randint(1, 4) + [1.0] * rng.randint(1, 6))
            groups.append(100 + p)
    if hole:
        masks[0] = [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    return Layout(masks, groups)


def outcome_rewards(layout: Layout, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    out = []
    for m in layout.masks:
        r = [0.0] * len(m)
        last = max(i for i, v in enumerate(m) if v > 0)
        r[last] = float(rng.choice([0.0, 1.0, 0.5, -1.0]))
        out.append(r)
    return out


def dense_rewards(layout: Layout, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.gauss(0, 1) if v > 0 else 0.0 for v in m] for m in layout.masks]


def whiten_ref(per_seq: list[list[float]], masks: list[list[float]]) -> list[list[float]]:
    flat = [a for s, m in zip(per_seq, masks) for a, v in zip(s, m) if v > 0]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [
        [(a - mean) / math.sqrt(var + 1e-8) if v > 0 else 0.0 for a, v in zip(s, m)]
        for s, m in zip(per_seq, masks)
    ]


def seq_scores(rewards: list[list[float]], masks: list[list[float]]) -> list[float]:
    return [sum(r for r, v in zip(rs, m) if v > 0) for rs, m in zip(rewards, masks)]


def run(name: str, layout: Layout, rewards, cfg: AlgorithmConfig | None = None, **extra):
    cfg = cfg or AlgorithmConfig(adv_estimator=name)
    inputs = AdvantageInputs(
        layout.packed(rewards), layout.mask, layout.cu_seqlens, index=torch.tensor(layout.groups), **extra
    )
    adv, ret = get_adv_estimator(name)(inputs, cfg)
    return layout.split(adv), layout.split(ret)


def assert_close(got: list[list[float]], want: list[list[float]], tol: float = 1e-10) -> None:
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert abs(a - b) <= tol, f"{g} != {w}"


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0)])
def test_gae(gamma, lam):
    layout = random_layout(0)
    rewards = dense_rewards(layout, 1)
    rng = random.Random(2)
    values = [[rng.gauss(0, 1) for _ in m] for m in layout.masks]
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam)
    adv, ret = run("gae", layout, rewards, cfg, values=layout.packed(values))
    raw, want_ret = [], []
    for r, v, m in zip(rewards, values, layout.masks):
        pos = [t for t, x in enumerate(m) if x > 0]
        a_seq, a_next = [0.0] * len(m), 0.0
        for k in reversed(range(len(pos))):
            v_next = v[pos[k + 1]] if k + 1 < len(pos) else 0.0
            delta = r[pos[k]] + gamma * v_next - v[pos[k]]
            a_next = delta + gamma * lam * a_next
            a_seq[pos[k]] = a_next
        raw.append(a_seq)
        want_ret.append([(a + vv) * x for a, vv, x in zip(a_seq, v, m)])
    assert_close(adv, whiten_ref(raw, layout.masks))
    assert_close(ret, want_ret)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_and_dr_grpo(norm):
    layout = random_layout(3, hole=False)
    rewards = outcome_rewards(layout, 4)
    cfg = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)
    adv, ret = run("grpo", layout, rewards, cfg)
    scores = seq_scores(rewards, layout.masks)
    want = []
    for i, m in enumerate(layout.masks):
        group = [scores[j] for j in range(len(scores)) if layout.groups[j] == layout.groups[i]]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        a = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
        want.append([a * v for v in m])
    assert_close(adv, want, 1e-9)
    assert_close(ret, want, 1e-9)


def test_rloo_is_leave_one_out():
    layout = random_layout(5)
    rewards = outcome_rewards(layout, 6)
    adv, _ = run("rloo", layout, rewards)
    scores = seq_scores(rewards, layout.masks)
    want = []
    for i, m in enumerate(layout.masks):
        others = [scores[j] for j in range(len(scores)) if layout.groups[j] == layout.groups[i] and j != i]
        a = scores[i] - sum(others) / len(others) if others else scores[i]
        want.append([a * v for v in m])
    assert_close(adv, want)


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_plus_plus(gamma):
    layout = random_layout(7)
    rewards = dense_rewards(layout, 8)
    adv, ret = run(
        "reinforce_plus_plus",
        layout,
        rewards,
        AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=gamma),
    )
    returns = []
    for r, m in zip(rewards, layout.masks):
        g = [0.0] * len(m)
        for t in reversed(range(len(m))):
            if m[t] > 0:
                following = g[t + 1] if t + 1 < len(m) and m[t + 1] > 0 else 0.0
                g[t] = r[t] + gamma * following
        returns.append(g)
    assert_close(ret, returns)
    assert_close(adv, whiten_ref(returns, layout.masks))


def test_reinforce_plus_plus_baseline():
    layout = random_layout(9)
    rewards = outcome_rewards(layout, 10)
    adv, _ = run("reinforce_plus_plus_baseline", layout, rewards)
    scores = seq_scores(rewards, layout.masks)
    centred = []
    for i, m in enumerate(layout.masks):
        group = [scores[j] for j in range(len(scores)) if layout.groups[j] == layout.groups[i]]
        base = sum(group) / len(group) if len(group) > 1 else 0.0
        centred.append([(scores[i] - base) * v for v in m])
    assert_close(adv, whiten_ref(centred, layout.masks))


def test_remax():
    layout = random_layout(11)
    rewards = dense_rewards(layout, 12)
    baselines = [0.1 * i - 0.3 for i in range(len(layout.masks))]
    adv, ret = run("remax", layout, rewards, reward_baselines=torch.tensor(baselines, dtype=torch.float64))
    want_ret, want_adv = [], []
    for r, m, b in zip(rewards, layout.masks, baselines):
        g = [sum(r[u] for u in range(t, len(m)) if m[u] > 0) if m[t] > 0 else 0.0 for t in range(len(m))]
        want_ret.append(g)
        want_adv.append([(x - b) if v > 0 else 0.0 for x, v in zip(g, m)])
    assert_close(ret, want_ret)
    assert_close(adv, want_adv)


def test_missing_inputs_and_unknown_names_raise():
    layout = random_layout(0)
    inputs = AdvantageInputs(layout.packed(dense_rewards(layout, 0)), layout.mask, layout.cu_seqlens)
    with pytest.raises(ValueError, match="values"):
        AlgorithmConfig(adv_estimator="gae").build_estimator()(inputs)
    with pytest.raises(ValueError, match="index"):
        AlgorithmConfig(adv_estimator="grpo").build_estimator()(inputs)
    with pytest.raises(ValueError, match="reward_baselines"):
        AlgorithmConfig(adv_estimator="remax").build_estimator()(inputs)
    with pytest.raises(ValueError, match="rloo"):
        AlgorithmConfig(adv_estimator="ppo")
    with pytest.raises(ValueError, match="low_var_kl"):
        AlgorithmConfig(kl_penalty="k4")


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_traits_declare_exactly_the_inputs_each_estimator_needs(name):
    """The loop builds a critic / generates greedy baselines from the registered traits: an estimator runs
    without values (baselines) exactly when its traits say it needs no critic (greedy baseline)."""
    layout = random_layout(2)
    full = {
        "values": layout.packed(dense_rewards(layout, 3)),
        "reward_baselines": torch.zeros(len(layout.masks), dtype=torch.float64),
    }
    traits = adv_estimator_traits(name)
    run(name, layout, dense_rewards(layout, 4), **full)
    for key, needed in (("values", traits.needs_critic), ("reward_baselines", traits.needs_greedy_baseline)):
        given = {k: v for k, v in full.items() if k != key}
        if needed:
            with pytest.raises(ValueError, match=key):
                run(name, layout, dense_rewards(layout, 4), **given)
        else:
            run(name, layout, dense_rewards(layout, 4), **given)
    assert adv_estimator_traits("gae").needs_critic and adv_estimator_traits("remax").needs_greedy_baseline


def test_scores_land_on_the_last_response_token():
    layout = random_layout(13)
    scores = torch.arange(len(layout.masks), dtype=torch.float64) + 1
    got = layout.split(scores_to_token_rewards(scores, layout.mask, layout.cu_seqlens))
    want = []
    for s, m in zip(scores.tolist(), layout.masks):
        last = max(i for i, v in enumerate(m) if v > 0)
        want.append([s if i == last else 0.0 for i in range(len(m))])
    assert_close(got, want)
    inputs = AdvantageInputs.from_scores(
        scores, layout.mask, layout.cu_seqlens, index=torch.tensor(layout.groups)
    )
    adv, _ = AlgorithmConfig(adv_estimator="grpo").build_estimator()(inputs)
    assert_close(layout.split(adv), run("grpo", layout, want)[0])


def test_kl_in_reward_with_fixed_and_adaptive_controllers():
    layout = random_layout(14)
    rng = random.Random(15)
    old = [[rng.gauss(-2, 0.5) for _ in m] for m in layout.masks]
    ref = [[rng.gauss(-2, 0.5) for _ in m] for m in layout.masks]
    scores = outcome_rewards(layout, 16)
    ctrl = AdaptiveKLController(0.2, target_kl=0.05, horizon=100)
    rewards, metrics = apply_kl_penalty(
        layout.packed(scores),
        layout.packed(old),
        layout.packed(ref),
        layout.mask,
        layout.cu_seqlens,
        ctrl,
        "kl",
    )
    per_seq = []
    for o, r, m in zip(old, ref, layout.masks):
        per_seq.append(sum((a - b) * v for a, b, v in zip(o, r, m)) / sum(m))
    assert_close(
        layout.split(rewards),
        [
            [x - 0.2 * (a - b) * v for x, a, b, v in zip(s, o, r, m)]
            for s, o, r, m in zip(scores, old, ref, layout.masks)
        ],
    )
    current = sum(per_seq) / len(per_seq)
    assert abs(metrics["actor/reward_kl_penalty"] - current) < 1e-12
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2
    error = min(max(current / 0.05 - 1, -0.2), 0.2)
    assert abs(ctrl.value - 0.2 * (1 + error * len(layout.masks) / 100)) < 1e-12
    fixed = KLControlConfig(type="fixed", kl_coef=0.3).build()
    assert isinstance(fixed, FixedKLController) and not isinstance(fixed, AdaptiveKLController)
    apply_kl_penalty(
        layout.packed(scores),
        layout.packed(old),
        layout.packed(ref),
        layout.mask,
        layout.cu_seqlens,
        fixed,
        "k3",
    )
    assert fixed.value == 0.3
    restored = KLControlConfig(type="adaptive", kl_coef=1.0).build()
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    built = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.05, horizon=100).build()
    assert isinstance(built, AdaptiveKLController) and (built.value, built.target, built.horizon) == (
        0.2,
        0.05,
        100,
    )
    with pytest.raises(ValueError, match="fixed or adaptive"):
        KLControlConfig(type="pid")
