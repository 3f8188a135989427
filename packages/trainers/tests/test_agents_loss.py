"""The masked loss on a multi-turn batch against a float64 reference: only the model's sampled ids count.

Two episodes of one GRPO group, each with environment ids between two model turns, go through ``build_batch``,
GRPO advantages and the actor loss on a tiny model's float32 log-probs; the reference recomputes everything in
float64 by hand over the model's ids only (log-probs from a float64 copy of the model, the group-normalised
score, the clipped ratio, the token mean).
"""

from __future__ import annotations

import copy
import math

import torch

from posttrain.core.batch import loss_context
from posttrain.core.rollout import RolloutSample
from posttrain.trainers.algorithms import AlgorithmConfig
from posttrain.trainers.algorithms.policy import ActorLossConfig
from posttrain.trainers.rl.batch import build_batch
from posttrain.trainers.rl.phases import compute_advantages

PROMPT = [5, 17, 42]
EPISODES = [  # (response ids, mask: 1 = sampled by the model, score)
    ([30, 31, 32, 3, 9, 9, 9, 4, 33, 34], [1, 1, 1, 1, 0, 0, 0, 0, 1, 1], 1.0),
    ([40, 41, 3, 8, 8, 4, 42, 43, 44], [1, 1, 1, 0, 0, 0, 1, 1, 1], 0.0),
]


def token_log_probs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids),) log p(ids[t] | ids[:t]), 0 at t = 0."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=lp.dtype), lp])


def test_masked_multi_turn_loss_matches_float64():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(
        Qwen2Config(vocab_size=64, num_key_value_heads=1, **shape)
    ).float()
    ref64 = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(0)
    samples = []
    for ids, mask, _ in EPISODES:  # behaviour log-probs: the model's own, perturbed (an older policy)
        lp = token_log_probs(model, PROMPT + ids)[len(PROMPT) :]
        behaviour = (lp + 0.3 * torch.randn(len(ids), generator=gen)) * torch.tensor(mask)
        samples.append(RolloutSample(0, PROMPT, ids, behaviour.float(), "stop", response_mask=mask))
    batch = build_batch(samples, [s for *_, s in EPISODES], [0, 0], temperature=1.0)
    batch.fields["old_log_probs"] = batch.fields["rollout_log_probs"] * batch.loss_mask
    compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"), None)
    new = torch.cat([token_log_probs(model, PROMPT + ids) for ids, _, _ in EPISODES]).float()
    cfg = ActorLossConfig(loss_agg_mode="token-mean", clip_ratio=0.2)
    loss, _ = cfg.build_loss(loss_scale_factor=1.0)({"log_probs": new}, batch, loss_context(batch))

    scores = [s for *_, s in EPISODES]
    mean = sum(scores) / 2
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / 1)
    terms = []
    for (ids, mask, score), sample in zip(EPISODES, samples):
        adv = (score - mean) / (std + 1e-6)
        lp64 = token_log_probs(ref64, PROMPT + ids)[len(PROMPT) :]
        for t, m in enumerate(mask):
            if m:
                ratio = math.exp(float(lp64[t]) - float(sample.log_probs[t]))
                terms.append(max(-adv * ratio, -adv * min(max(ratio, 0.8), 1.2)))
    assert int(batch.loss_mask.sum()) == len(terms) == sum(sum(m) for _, m, _ in EPISODES)
    assert abs(float(loss) - sum(terms) / len(terms)) < 1e-5
