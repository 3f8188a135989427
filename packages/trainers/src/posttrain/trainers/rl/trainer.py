"""PPO and GRPO: SPMD under torchrun with the rollout colocated in every process.

One step: the next ``data.train_batch_size`` prompts (global; each data-parallel rank takes its share) ->
generate ``rollout.n`` responses each -> reward -> old log-probs (actor) -> reference log-probs (when
``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``; a LoRA actor with its adapter off is the reference)
-> values (critic) -> advantages -> critic update -> actor update (after ``trainer.critic_warmup`` steps)
over ``actor.ppo_mini_batch_size``-prompt mini-batches -> weight sync into the rollout. Whether a critic is
built and trained (gae) or a greedy response per prompt is generated for the baseline (remax) is what the
estimator declared when it was registered (:class:`~posttrain.trainers.algorithms.EstimatorTraits`). Sampling
is seeded from ``(trainer.seed, rollout.seed, step, data-parallel rank)``, so a resumed run replays exactly
what an uninterrupted one would have done.

Where this departs from verl: there is no Ray and no separate rollout server; the rollout lives in the trainer
process (verl's HYBRID mode), and advantages are computed on each rank for its own prompt groups (all n
samples of a prompt are generated on one rank, so group statistics need no communication).

MoE router replay (``actor.engine.router_replay.mode`` R2 or R3, megatron engine) makes the updates use the
experts recorded by the old-log-prob pass (R2) or by the rollout (R3); see :mod:`.router_replay`.

Model-parallel engine layouts (Megatron TP/PP/CP > 1) put several ranks on one data-parallel rank (a replica
group, :class:`~posttrain.trainers.distributed.Replicas`); the engine returns outputs and loss metrics on one
of them. That source rank generates and scores the group's rollouts and broadcasts them, so every rank of the
group packs the same batch; forward outputs (old / reference log-probs, entropy, values) and update metrics
are broadcast from it too, so the advantages and the logged metrics are the same on every rank. Every role
must use the actor's layout.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.ckpt import CheckpointManager, load_trainer_state

from .. import distributed as pdist
from .. import threads
from ..algorithms import adv_estimator_traits
from ..config import PostTrainConfig
from ..data.sampler import StatefulSampler, rank_slice
from ..loop import StepLoop
from ..model_files import load_tokenizer, require_model_weights
from ..resume import resume_point
from ..rewards import RewardManager, reward_metrics
from . import phases, router_replay
from .auto_memory import choose_memory_trades
from .batch import build_batch
from .dataset import PromptDataset
from .generation import RolloutSampler, WeightSync
from .modes import build_rollout
from .step_metrics import Timer


class RLTrainer(StepLoop):
    """PPO / GRPO over engines and a rollout built by their configs, with rollouts from the mode's source."""

    command = "ppo"  # config.yaml names its estimator, so `posttrain ppo --config` reruns a GRPO run too

    def __init__(self, cfg: PostTrainConfig) -> None:
        self.cfg = cfg
        self.owns_group = pdist.init_distributed()
        pdist.check_world_size(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
        torch.manual_seed(cfg.trainer.seed)
        self.estimator = adv_estimator_traits(cfg.algorithm.adv_estimator)
        self.use_critic = self.estimator.needs_critic
        self.use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self._check_config()
        self.tokenizer = load_tokenizer(cfg.model)
        self.train_set = PromptDataset(cfg.data.train_files, self.tokenizer, cfg.data)
        self.val_set = (
            PromptDataset(cfg.data.val_files, self.tokenizer, cfg.data, key="data.val_files")
            if cfg.data.val_files
            else None
        )
        self.sampler = StatefulSampler(
            len(self.train_set), cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        steps = cfg.trainer.total_training_steps or self.sampler.steps_per_epoch * cfg.trainer.total_epochs
        self.total_steps = steps
        choose_memory_trades(cfg, pdist.world_size(), pdist.rank(), critic=self.use_critic)
        self._build_engines()
        self.dp_size = self.actor.get_data_parallel_size()
        self.dp_rank = self.actor.get_data_parallel_rank()
        self.replicas = self._replica_groups()
        self._check_batch_sizes()
        self.prompts_per_rank = cfg.data.train_batch_size // self.dp_size
        self.rollout = self._build_rollout()
        self.agent = cfg.agent.build(self.tokenizer, cfg.rollout)  # None: single-turn rollouts
        self.kl_ctrl = cfg.algorithm.kl_ctrl.build()
        self.actor_loss = cfg.actor.build_loss(loss_scale_factor=float(cfg.rollout.response_length))
        self.critic_loss = cfg.critic.build_loss() if self.use_critic else None
        self.weights = WeightSync(self.actor, self.rollout, cfg.rollout.dtype)
        self.sampling = self._rollout_sampler()
        self.source = cfg.trainer.build_rollout_source(
            sampler=self.sampling,
            weights=self.weights,
            draw=self.draw_prompts,
            replicas=self.replicas,
            prompts_per_rank=self.prompts_per_rank,
            total_steps=self.total_steps,
            n=cfg.rollout.n,
            free_cache=cfg.rollout.free_cache_engine,
        )
        self.ckpt = CheckpointManager(cfg.trainer.default_local_dir, cfg.checkpoint)
        self.global_step = self._resume()
        self.tracker = self.make_tracker()
        self.weights.sync(version=self.global_step)
        self.source.start(self.global_step)

    # ------------------------------------------------------------------ set-up
    def _build_rollout(self) -> Any:
        """The rollout where ``trainer.rollout_placement`` says (chosen here when unset, and printed)."""
        cfg = self.cfg
        placed = cfg.trainer.choose_placement(self.actor.device, cfg.rollout)
        if placed is not None and pdist.rank() == 0:
            print(f"[posttrain] {placed.line('trainer.rollout_placement')}", file=sys.stderr)
        agent = (cfg.agent, self.tokenizer) if cfg.agent.env is not None else None
        return build_rollout(cfg, device=self.actor.device, agent=agent)

    def _check_config(self) -> None:
        """Refuse, before anything is built, a model path without weights, a router replay mode the actor's
        engine cannot do, or two different prompt lengths (the micro-batch token budgets are filled in by
        :func:`.auto_memory.choose_memory_trades`)."""
        cfg = self.cfg
        require_model_weights(
            cfg.model, cfg.actor.engine, rollout_loads_weights=cfg.rollout.load_format != "dummy"
        )
        if self.use_critic and cfg.critic.model.path:
            cfg.critic.model.require_weights("critic.model.path")
        self.replay_mode = router_replay.replay_mode(
            cfg.actor.engine.router_replay.mode,
            cfg.actor.engine.engine_class("language_model"),
            cfg.rollout.return_routed_experts,
        )
        cfg.trainer.check_estimator(self.estimator)
        phases.check_behaviour_old_log_probs(cfg.algorithm.rollout_correction, cfg.rollout, self.replay_mode)
        cfg.data.max_prompt_length = cfg.data.prompt_length(cfg.rollout.prompt_length)

    def _new_engine(self, model_type: str, role_cfg: Any, model_cfg: Any, optim: Any = None) -> Any:
        optim = optim or self.cfg.actor.optim
        if optim.total_training_steps < 0:
            optim = dataclasses.replace(optim, total_training_steps=self.total_steps)
        return role_cfg.engine.build(model_type, model=model_cfg, optim=optim, ckpt=self.cfg.checkpoint)

    def _build_engines(self) -> None:
        cfg = self.cfg
        self.actor = self._new_engine("language_model", cfg.actor, cfg.model, cfg.actor.optim)
        self.lora_ref = self.use_ref and cfg.model.lora_rank > 0
        self.ref = None
        if self.use_ref and not self.lora_ref:
            self.ref = self._new_engine("language_model", cfg.ref, cfg.model)
        self.critic = None
        if self.use_critic:
            critic_model = (
                cfg.critic.model
                if cfg.critic.model.path
                else dataclasses.replace(cfg.critic.model, path=cfg.model.path)
            )
            self.critic = self._new_engine("value_model", cfg.critic, critic_model, cfg.critic.optim)

    def _replica_groups(self) -> pdist.Replicas:
        """The actor's replica groups; the reference and the critic must share the actor's layout."""
        replicas = pdist.replica_groups(self.actor)
        for role, engine in (("ref", self.ref), ("critic", self.critic)):
            if engine is not None and pdist.engine_layout(engine) != replicas.layout:
                raise ValueError(
                    f"{role}.engine has another parallel layout than actor.engine: give both the same "
                    "strategy and tensor/pipeline/context parallel sizes"
                )
        return replicas

    def _check_batch_sizes(self) -> None:
        cfg = self.cfg
        if cfg.data.train_batch_size % self.dp_size:
            raise ValueError(
                f"data.train_batch_size={cfg.data.train_batch_size} does not split over "
                f"{self.dp_size} data-parallel ranks: make it a multiple of {self.dp_size}"
            )
        for role in ("actor", "critic") if self.use_critic else ("actor",):
            mini = getattr(cfg, role).ppo_mini_batch_size
            if cfg.data.train_batch_size % mini:
                raise ValueError(
                    f"data.train_batch_size={cfg.data.train_batch_size} is not a multiple of "
                    f"{role}.ppo_mini_batch_size={mini}: both count prompts; make it a multiple"
                )

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> int:
        point = resume_point(self.cfg.trainer)
        if point is None:
            return 0
        step, path = point
        self.actor.load_checkpoint(str(path / "actor"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(path / "critic"))
        state = load_trainer_state(path)
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        threads.keep(state.get("torch_threads"))
        self.source.restore(path)
        if pdist.rank() == 0:
            print(f"resumed from {path} (step {step})", file=sys.stderr)
        return step

    def prepare_checkpoints(self) -> None:
        self.actor.prepare_checkpoint("actor", self.ckpt.writer)
        if self.critic is not None:
            self.critic.prepare_checkpoint("critic", self.ckpt.writer)

    def save_checkpoint(self, step: int) -> Path:
        staging = self.ckpt.stage(step)
        kwargs = {"writer": self.ckpt.writer} if self.ckpt.writer is not None else {}
        self.actor.save_checkpoint(str(staging / "actor"), global_step=step, **kwargs)
        if self.critic is not None:
            self.critic.save_checkpoint(str(staging / "critic"), global_step=step, **kwargs)
        self.ckpt.save_trainer_state(
            step,
            {
                "global_step": step,
                "sampler": self.sampler.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "torch_threads": torch.get_num_threads(),
            },
        )
        self.source.save(self.ckpt, step)  # one_step_off / async: the generated, not yet trained groups
        return self.ckpt.commit(step)

    # ------------------------------------------------------------------ rollout
    def _rollout_sampler(self) -> RolloutSampler:
        return RolloutSampler(
            self.rollout,
            self.tokenizer,
            RewardManager(self.cfg.reward),
            self.cfg.rollout,
            trainer_seed=self.cfg.trainer.seed,
            dp_rank=self.dp_rank,
            replicas=self.replicas,
            weights=self.weights,
            agent=self.agent,
        )

    @property
    def weight_version(self) -> int | None:
        """The version of the weights last synced into the rollout (the actor's updates so far)."""
        return self.weights.version

    def draw_prompts(self) -> tuple[int, list]:
        """(epoch, this rank's prompts) of the sampler's next batch."""
        epoch, indices = self.sampler.next_batch()
        return epoch, [self.train_set[i] for i in rank_slice(indices, self.dp_rank, self.dp_size)]

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        cfg, timer = self.cfg, Timer()
        step_start = time.perf_counter()
        n = cfg.rollout.n
        prompts, got, metrics = self.source.next_batch(self.global_step, timer)
        samples, scores, sources, reward_extras = got["samples"], got["scores"], got["sources"], got["extras"]
        uids = [self.dp_rank * self.prompts_per_rank + s.prompt_index for s in samples]
        batch = build_batch(samples, scores, uids, cfg.rollout.temperature)
        if got.get("versions") is not None:
            batch.seq_fields["policy_version"] = torch.tensor(got["versions"], dtype=torch.long)
        if self.replay_mode == "R3":
            router_replay.require_rollout_routing(batch, cfg.rollout.name)
        metrics["train/epoch"] = got["epoch"]
        metrics.update(self._old_log_probs(batch, timer))
        if self.use_ref:
            with timer("ref"):
                phases.compute_ref_log_probs(
                    self.ref or self.actor, batch, self.replicas, adapter_off=self.lora_ref
                )
        if self.critic is not None:
            with timer("values"):
                phases.compute_values(self.critic, batch, self.replicas)
        with timer("adv"):
            baselines = (
                self.sampling.greedy_baselines(prompts, n, self.global_step)
                if self.estimator.needs_greedy_baseline
                else None
            )
            metrics.update(phases.compute_advantages(batch, cfg.algorithm, self.kl_ctrl, baselines))
        with timer("sleep"):
            metrics.update(self.source.sleep())
        metrics.update(self._update_models(batch, timer))
        metrics.update(timer)
        metrics.update(self._batch_metrics(batch, scores, sources, uids, time.perf_counter() - step_start))
        return {**self._reduce(metrics), **reward_extras}

    def _old_log_probs(self, batch, timer: Timer) -> dict[str, float]:
        """The proximal policy's log-probs (the old-log-prob pass, or the rollout's with
        ``old_log_prob=behaviour``), then the rollout correction's weights when it is on."""
        correction = self.cfg.algorithm.rollout_correction
        if correction.old_log_prob == "behaviour":
            phases.behaviour_old_log_probs(batch)
            return {}
        with timer("old_log_prob"):
            metrics = phases.compute_old_log_probs(self.actor, batch, self.replicas, self.replay_mode)
        if correction.enabled:
            metrics.update(phases.compute_rollout_correction(batch, correction))
        return metrics

    def _update_models(self, batch, timer: Timer) -> dict[str, float]:
        """Critic update, then (after the warmup) actor update and weight sync."""
        cfg, metrics = self.cfg, {}
        common = {"n": cfg.rollout.n, "dp_size": self.dp_size, "replicas": self.replicas}
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(
                    phases.update(
                        self.critic,
                        batch,
                        self.critic_loss,
                        epochs=cfg.critic.ppo_epochs,
                        prompts_per_mini=cfg.critic.ppo_mini_batch_size,
                        generator=None,
                        prefix="critic",
                        **common,
                    )
                )
        if self.global_step < cfg.trainer.critic_warmup:
            return metrics
        gen = (
            torch.Generator().manual_seed(cfg.trainer.seed + self.global_step) if cfg.actor.shuffle else None
        )
        with timer("update_actor"):
            metrics.update(
                phases.update(
                    self.actor,
                    batch,
                    self.actor_loss,
                    epochs=cfg.actor.ppo_epochs,
                    prompts_per_mini=cfg.actor.ppo_mini_batch_size,
                    generator=gen,
                    prefix="actor",
                    **common,
                )
            )
        metrics.update(self.source.after_update(self.global_step))
        return metrics

    def _batch_metrics(self, batch, scores, sources, uids, step_s: float) -> dict[str, float]:
        lengths = batch.seq_fields["response_length"]
        out = reward_metrics(scores, sources, uids, prefix="reward")
        out.update(
            {
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "response_length/clip_ratio": float(
                    (lengths >= self.cfg.rollout.response_length).float().mean()
                ),
                "perf/step_s": step_s,
                "perf/tokens": float(batch.num_tokens),
            }
        )
        return out

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average every metric over ranks (tokens summed over data-parallel ranks) and add throughput; the
        ranks of a replica group hold the same values, so this is the mean over data-parallel ranks."""
        keys = sorted(metrics)
        values = pdist.all_reduce([metrics[k] for k in keys])
        world = pdist.world_size()
        out = {k: v / (self.replicas.size if k == "perf/tokens" else world) for k, v in zip(keys, values)}
        out["perf/tokens_per_s"] = out["perf/tokens"] / max(out["perf/step_s"], 1e-9)
        return out

    # ------------------------------------------------------------------ validation and loop
    def validate(self) -> dict[str, float]:
        """Greedy (rollout.val_temperature) reward over the whole validation set."""
        if self.val_set is None:
            return {}
        self.source.before_validate(self.global_step)
        mine = [self.val_set[i] for i in range(len(self.val_set))][self.dp_rank :: self.dp_size]
        _, scores, sources, _ = self.sampling.generate(mine, validate=True) if mine else ([], [], [], {})
        total, count = pdist.all_reduce([sum(scores), len(scores)])
        return {"val/reward/mean": total / max(count, 1.0)}

    def release(self) -> None:
        self.source.close()
        if self.agent is not None:
            self.agent.close()
        self.rollout.release()
