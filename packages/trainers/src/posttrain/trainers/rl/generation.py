"""The trainer's two handles on its rollout: the weight path into it and the scored sampling out of it.

:class:`WeightSync` streams the actor's weights into the rollout (directly, or as a snapshot a background
thread pushes) and remembers the version the rollout should serve; :class:`RolloutSampler` samples responses
with a step's seed, scores them, and checks first that the rollout serves the synced version. The rollout
sources of :mod:`.modes` are built from these two and a prompt-drawing callable, not from the trainer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from posttrain.core.rollout import SamplingConfig
from posttrain.core.weight_sync import WeightSyncError

from .step_metrics import extra_means


def step_seed(trainer_seed: int, rollout_seed: int, step: int, dp_rank: int) -> int:
    """The sampling seed of one generate call: a fixed mix of ``trainer.seed``, ``rollout.seed``, the step and
    the data-parallel rank (``rollout.seed=0``, the default, leaves the mix as it was before the rollout seed
    joined it)."""
    return (trainer_seed * 1_000_003 + rollout_seed * 104_729 + step * 7919 + dp_rank * 131) % (2**31)


class WeightSync:
    """Moves the actor's weights into the rollout and tracks the version the rollout should serve (the actor's
    updates so far). A LoRA actor sends its base weights once, then only the adapter (``base_synced``)."""

    def __init__(self, actor: Any, rollout: Any, dtype: str) -> None:
        self.actor, self.rollout, self.dtype = actor, rollout, dtype
        self.base_synced = False
        self.version: int | None = None
        """The version of the last sync (None before the first)."""

    def _merge(self) -> bool:
        return not getattr(self.rollout, "supports_lora_adapters", False)

    def sync(self, version: int) -> dict[str, float]:
        """Stream the weights into the rollout now (verified by checksums on the receiving side)."""
        start = time.perf_counter()
        self.rollout.wake_up(["weights"])
        with self.actor.eval_mode():  # as stored: the rollout's sender casts to rollout.dtype while packing
            stream, peft_config = self.actor.get_per_tensor_param(
                base_sync_done=self.base_synced, peft_merge=self._merge()
            )
            report = self.rollout.update_weights(
                stream, peft_config=peft_config, base_sync_done=self.base_synced, version=version
            )
        self.base_synced = peft_config is not None
        self.version = version
        self.rollout.wake_up(["kv_cache"])
        return {
            "timing_s/update_weights": time.perf_counter() - start,
            "sync/tensors": report.num_tensors,
            "sync/megabytes": report.num_bytes / 2**20,
        }

    def snapshot(self) -> tuple[list, Any, bool]:
        """(a copy of the weights in the rollout's dtype, peft config, base_sync_done) for :meth:`push` on a
        background thread while the actor trains on (taken on the calling thread: it may gather shards)."""
        with self.actor.eval_mode():
            stream, peft_config = self.actor.get_per_tensor_param(
                base_sync_done=self.base_synced, dtype=self.dtype, peft_merge=self._merge()
            )
            snapshot = [(name, t.detach().clone()) for name, t in stream]
        base_done, self.base_synced = self.base_synced, peft_config is not None
        return snapshot, peft_config, base_done

    def push(self, snapshot: list, peft_config: Any, base_sync_done: bool, version: int) -> float:
        """Load a :meth:`snapshot` into the rollout (a background job); returns its seconds."""
        start = time.perf_counter()
        self.rollout.wake_up(["weights"])
        self.rollout.update_weights(
            iter(snapshot), peft_config=peft_config, base_sync_done=base_sync_done, version=version
        )
        self.rollout.wake_up(["kv_cache"])
        return time.perf_counter() - start

    def served(self) -> int | None:
        """The weight version the rollout reports serving."""
        return self.rollout.weight_version()

    def check(self) -> None:
        """Refuse to roll out unless the rollout serves the weights of the last sync."""
        served = self.served()
        if served != self.version:
            raise WeightSyncError(
                f"the rollout serves weight version {served}, but the actor's weights of step "
                f"{self.version} were synced last: the sync did not take effect, so generating now would "
                "sample from stale weights"
            )

    def sleep_rollout(self) -> dict[str, float]:
        """Free the rollout's memory for training: sleep level 2 (weights and KV cache dropped) when the next
        sync carries every weight, level 1 (weights kept) when it carries a LoRA adapter only."""
        self.rollout.sleep(level=1 if self.base_synced else 2)
        stats = getattr(self.rollout, "memory_stats", {})
        return {f"rollout/{k}": float(v) for k, v in stats.items()}


class RolloutSampler:
    """Samples ``rollout.n`` responses per prompt with a step's seed and scores them with the rewards."""

    def __init__(
        self,
        rollout: Any,
        tokenizer: Any,
        rewards: Any,
        rollout_cfg: Any,
        *,
        trainer_seed: int,
        dp_rank: int,
        replicas: Any,
        weights: WeightSync,
        agent: Any = None,
    ) -> None:
        """``agent``: the multi-turn agent loop (``agent.build``), None for single-turn rollouts."""
        self.agent = agent
        self.rollout, self.tokenizer, self.rewards, self.rollout_cfg = (
            rollout,
            tokenizer,
            rewards,
            rollout_cfg,
        )
        self.trainer_seed, self.dp_rank, self.replicas, self.weights = (
            trainer_seed,
            dp_rank,
            replicas,
            weights,
        )

    def sampling(self, step: int, *, validate: bool = False, rollout_cfg: Any = None) -> SamplingConfig:
        """The sampling of ``step``: the knobs of ``rollout_cfg`` (default: the run's ``rollout``), the step's
        seed, the tokenizer's eos as the stop token."""
        rollout_cfg = rollout_cfg or self.rollout_cfg
        sampling = rollout_cfg.sampling(validate=validate)
        sampling.seed = step_seed(self.trainer_seed, rollout_cfg.seed, step, self.dp_rank)
        eos = self.tokenizer.eos_token_id
        sampling.stop_token_ids = [eos] if eos is not None else []
        return sampling

    def sample_and_score(
        self, prompts: list, step: int, *, validate: bool = False, rollout_cfg: Any = None
    ) -> tuple[list, list[float], list, dict]:
        """(samples grouped by prompt, scores, data sources, per-sample reward extras), sampled with the seed
        of ``step`` and the sampling knobs of ``rollout_cfg`` (default: the run's ``rollout``)."""
        sampling = self.sampling(step, validate=validate, rollout_cfg=rollout_cfg)
        if self.agent is not None:  # multi-turn episodes with an environment (posttrain.trainers.agents)
            return self.agent.sample_and_score(self.rollout, prompts, sampling, self.rewards)
        samples = self.rollout.generate([p.ids for p in prompts], sampling)
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        owners = [prompts[s.prompt_index] for s in samples]
        result = self.rewards(
            [p.data_source for p in owners],
            texts,
            [p.ground_truth for p in owners],
            [p.extra_info for p in owners],
        )
        return samples, result.scores, [p.data_source for p in owners], result.extras

    def generate(
        self, prompts: list, step: int = 0, *, validate: bool = False, rollout_cfg: Any = None
    ) -> tuple[list, list[float], list, dict[str, float]]:
        """(samples, scores, data sources, reward extras averaged), made on the replica group's source rank
        from the synced weights and broadcast to the group."""
        result = None
        if self.replicas.is_src:
            self.weights.check()
            samples, scores, sources, extras = self.sample_and_score(
                prompts, step, validate=validate, rollout_cfg=rollout_cfg
            )
            result = samples, scores, sources, extra_means(extras)
        return self.replicas.broadcast(result)

    def greedy_baselines(self, prompts: list, n: int, step: int) -> torch.Tensor:
        """(B,) the reward of one greedy response per prompt, repeated for its ``n`` samples (remax)."""
        greedy = dataclasses.replace(self.rollout_cfg, temperature=0.0, n=1)
        _, scores, _, _ = self.generate(prompts, step, rollout_cfg=greedy)
        return torch.tensor(scores, dtype=torch.float32).repeat_interleave(n)
