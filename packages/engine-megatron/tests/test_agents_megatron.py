"""The Megatron engine's GRPO update on a multi-turn batch against an HF + plain-torch reference (one CPU
process).

Four episodes in two GRPO groups, with environment ids (tool calls' results, mask 0) between the model's turns
and rollout log-probs on the model's ids only (0 on the environment's), are packed by the trainer's
``build_batch``, get GRPO advantages from ``compute_advantages`` and old and reference log-probs on every id
(so only the loss mask keeps the environment's ids out), and take one optimizer step of the actor loss
(clipped policy loss with dual clip, plus the low-variance KL to a reference policy) on the Megatron engine in
two micro-batches of two sequences. The reference recomputes the loss by hand from a plain HF model's float64
log-probs over the model's ids only, back-propagates, clips the gradient norm and takes one
``torch.optim.AdamW`` step. Adam's epsilon is 1, so the first step is ``lr * g / (|g| + 1)``: each weight's
update follows its gradient's value, not only its sign, and equal updates mean equal gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42], [8, 9, 60, 61]]
EPISODES = [  # (prompt, response ids, mask: 1 = sampled by the model, 0 = the environment's, score)
    (0, [30, 31, 32, 3, 9, 9, 9, 4, 33, 34, 2], [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1], 1.0),
    (0, [40, 41, 3, 8, 8, 4, 42, 43, 44, 2], [1, 1, 1, 0, 0, 0, 1, 1, 1, 1], 0.0),
    (1, [50, 51, 52, 3, 7, 4, 53, 3, 6, 6, 4, 54, 2], [1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1], 0.0),
    (1, [60, 61, 3, 5, 5, 5, 4, 62, 63, 64, 65, 2], [1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1], 1.0),
]
LR, CLIP_LOW, CLIP_HIGH, CLIP_C, KL_COEF = 1e-2, 0.2, 0.28, 3.0, 0.1


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def multi_turn_batch(path: str):
    """The packed batch of :data:`EPISODES` as the trainer builds it. The older policy's log-probs (the
    model's own, perturbed; on one id of each failed episode far enough below for the dual clip to act) are
    the rollout's log-probs on the model's ids (0 on the environment's, as the agent loop records them) and
    the recomputed ``old_log_probs`` on every id, as the actor recomputes them: only the loss mask leaves the
    environment's ids out. Reference log-probs perturbed the other way; GRPO advantages."""
    from megatron_cpu import hf_log_probs

    from posttrain.core.batch import PackedBatch
    from posttrain.core.rollout import RolloutSample
    from posttrain.trainers.algorithms import AlgorithmConfig
    from posttrain.trainers.rl.batch import build_batch
    from posttrain.trainers.rl.phases import compute_advantages

    gen = torch.Generator().manual_seed(0)
    seqs = [PROMPTS[p] + ids for p, ids, _, _ in EPISODES]
    with torch.no_grad():
        own = hf_log_probs(hf_model(path), PackedBatch.from_sequences(seqs)).float()
    old = own + 0.3 * torch.randn(own.shape, generator=gen)
    ref = own - 0.3 * torch.rand(own.shape, generator=gen)
    samples, start = [], 0
    for p, ids, mask, score in EPISODES:
        first = start + len(PROMPTS[p])  # the episode's first response id, sampled by the model
        if not score:
            old[first] = own[first] + 1.5  # ratio exp(-1.5) < 1 - clip_low ...
            old[first + 1] = own[first + 1] - 1.5  # ... and exp(1.5) > clip_ratio_c, on negative advantages
        behaviour = old[first : first + len(ids)] * torch.tensor(mask, dtype=torch.float32)
        samples.append(RolloutSample(p, PROMPTS[p], ids, behaviour, "stop", response_mask=mask))
        start += len(PROMPTS[p]) + len(ids)
    batch = build_batch(samples, [s for *_, s in EPISODES], [p for p, *_ in EPISODES], temperature=1.0)
    assert torch.equal(batch.fields["rollout_log_probs"], old * batch.loss_mask)
    batch.fields["old_log_probs"], batch.fields["ref_log_probs"] = old, ref
    compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"), None)
    return batch


def reference_loss(log_probs: torch.Tensor, batch, agg: str) -> torch.Tensor:
    """The actor loss by hand (float64) from the new log-probs, over the batch's loss-masked ids."""
    old, adv = batch.fields["old_log_probs"].double(), batch.fields["advantages"].double()
    ratio = torch.exp(torch.clamp(log_probs - old, -20, 20))
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * CLIP_C), pg)
    d = torch.clamp(batch.fields["ref_log_probs"].double() - log_probs, -20, 20)
    per_token = pg + KL_COEF * torch.clamp(torch.exp(d) - d - 1, -10, 10)
    mask = batch.loss_mask.double()
    if agg == "token-mean":
        return (per_token * mask).sum() / mask.sum()
    sums = [(t * m).sum() / m.sum() for t, m in zip(batch.split_tokens(per_token), batch.split_tokens(mask))]
    return torch.stack(sums).mean()


def reference_step(path: str, batch, agg: str, clip: float):
    """(loss, grad norm before clipping, {HF name: update}) of one clipped AdamW step (eps 1) on the HF
    model."""
    from megatron_cpu import hf_log_probs

    model = hf_model(path)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss = reference_loss(hf_log_probs(model, batch), batch, agg)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    torch.optim.AdamW(model.parameters(), lr=LR, eps=1.0, weight_decay=0.0).step()
    return float(loss), norm, {k: v.detach() - before[k] for k, v in model.state_dict().items()}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_multi_turn_grpo_update_equals_hf_reference(megatron_env, tiny_qwen2, agg):
    from megatron_cpu import make_engine

    from posttrain.core.config import OptimizerConfig
    from posttrain.trainers.algorithms.policy import ActorLossConfig

    batch = multi_turn_batch(tiny_qwen2)
    env_ids = sum(m.count(0) for _, _, m, _ in EPISODES)
    assert env_ids > 0 and int(batch.loss_mask.sum()) == sum(sum(m) for _, _, m, _ in EPISODES)
    adv = batch.fields["advantages"][batch.loss_mask.bool()]
    assert (adv > 0).any() and (adv < 0).any()
    _, norm, _ = reference_step(tiny_qwen2, batch, agg, clip=math.inf)
    clip = norm / 2  # the clip is active, so the engine's clipping is compared too
    ref_loss, ref_norm, ref_update = reference_step(tiny_qwen2, batch, agg, clip)

    cfg = ActorLossConfig(
        loss_agg_mode=agg,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=CLIP_C,
        use_kl_loss=True,
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
    )
    optim = OptimizerConfig(lr=LR, eps=1.0, weight_decay=0.0, clip_grad=clip)
    eng = make_engine(tiny_qwen2, optim=optim, micro_batch_size_per_gpu=2)
    before = dict(eng.get_per_tensor_param()[0])
    before = {k: v.clone() for k, v in before.items()}
    with eng.train_mode():
        out = eng.train_batch(batch, cfg.build_loss(loss_scale_factor=1.0))
    assert len(out["loss"]) == 2  # 4 episodes, 2 per micro-batch: the global normalisation spans both
    assert sum(out["loss"]) == pytest.approx(ref_loss, abs=1e-6)
    assert out["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    metrics = out["metrics"]
    assert max(metrics["actor/pg_clipfrac"]) > 0 and max(metrics["actor/pg_clipfrac_lower"]) > 0
    after = dict(eng.get_per_tensor_param()[0])
    largest = max(float(u.abs().max()) for u in ref_update.values())
    for name, update in ref_update.items():
        torch.testing.assert_close(after[name] - before[name], update, atol=1e-4 * largest, rtol=0, msg=name)
