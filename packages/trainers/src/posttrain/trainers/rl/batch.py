"""Turn rollout samples into the packed batch the engines consume, and cut it into PPO mini-batches.

Each sample becomes one sequence ``prompt + response``; ``loss_mask`` is 1 on response tokens only (on a
multi-turn episode, on the ids the model sampled: ``RolloutSample.response_mask``). Per-token
fields: ``temperature`` (the sampling temperature, so training log-probs use the same distribution) and
``rollout_log_probs``, and ``routed_experts`` (T, MoE layers, k) when the rollout recorded its MoE routing
(see
:mod:`.router_replay`). Per-sequence fields: ``uid`` (the prompt's group: the n samples of one prompt share
it), ``score`` (the reward) and ``response_length``. Mini-batches follow verl's semantics:
``ppo_mini_batch_size`` counts prompts over all data-parallel ranks, so one mini-batch on one rank holds
``ppo_mini_batch_size * n / dp_size`` sequences, whole prompt groups kept together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.core.batch import PackedBatch
from posttrain.core.rollout import RolloutSample

from .router_replay import rollout_routing


def build_batch(
    samples: Sequence[RolloutSample], scores: Sequence[float], uids: Sequence[int], temperature: float
) -> PackedBatch:
    """Pack samples (grouped by prompt) with their scores and group ids."""
    seqs, masks, temps, rollout_lp = [], [], [], []
    for s in samples:
        n_prompt, n_resp = len(s.prompt_ids), len(s.response_ids)
        seqs.append(list(s.prompt_ids) + list(s.response_ids))
        sampled = s.response_mask if s.response_mask is not None else [1] * n_resp
        masks.append([0.0] * n_prompt + [float(m) for m in sampled])
        temps.append([max(temperature, 1e-6)] * (n_prompt + n_resp))
        rollout_lp.append(
            torch.cat([torch.zeros(n_prompt), torch.as_tensor(s.log_probs, dtype=torch.float32)])
        )
    batch = PackedBatch.from_sequences(seqs, masks, {"temperature": temps, "rollout_log_probs": rollout_lp})
    routed = rollout_routing(samples)
    if routed is not None:
        batch.fields["routed_experts"] = routed
    batch.seq_fields["uid"] = torch.as_tensor(list(uids), dtype=torch.long)
    batch.seq_fields["score"] = torch.as_tensor(list(scores), dtype=torch.float32)
    batch.seq_fields["response_length"] = torch.tensor(
        [len(s.response_ids) for s in samples], dtype=torch.float32
    )
    return batch


def token_level_scores(batch: PackedBatch) -> torch.Tensor:
    """(T,) the sequence score on its last response token, 0 elsewhere (verl's token_level_scores)."""
    out = torch.zeros_like(batch.loss_mask)
    ends = batch.cu_seqlens[1:].long() - 1
    has_response = batch.seq_fields["response_length"] > 0
    out[ends[has_response]] = batch.seq_fields["score"][has_response].to(out.dtype)
    return out


def mini_batches(
    batch: PackedBatch,
    num_prompts_per_mini: int,
    n: int,
    dp_size: int,
    generator: torch.Generator | None = None,
) -> list[PackedBatch]:
    """Split this rank's batch into mini-batches of whole prompt groups (shuffled when a generator is
    given)."""
    per_rank = num_prompts_per_mini * n
    if per_rank % dp_size:
        raise ValueError(
            f"actor.ppo_mini_batch_size x rollout.n = {per_rank} sequences do not split over "
            f"{dp_size} data-parallel ranks: make it a multiple of {dp_size}"
        )
    size = per_rank // dp_size
    if batch.num_seqs % size:
        raise ValueError(
            f"this rank's {batch.num_seqs} sequences do not split into mini-batches of {size}: make "
            "data.train_batch_size a multiple of actor.ppo_mini_batch_size"
        )
    order = list(range(batch.num_seqs))
    if generator is not None:
        groups = [order[i : i + n] for i in range(0, len(order), n)]
        perm = torch.randperm(len(groups), generator=generator).tolist()
        order = [i for g in perm for i in groups[g]]
    return [batch.select(order[i : i + size]) for i in range(0, len(order), size)]
