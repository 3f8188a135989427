"""How generation and training interleave: ``trainer.mode``, ``trainer.max_staleness``, ``trainer.stale_policy``,
and where the rollout runs: ``trainer.rollout_placement``, ``trainer.rollout_devices``.

:meth:`RolloutModeConfig.build_rollout_source` builds the object the trainer takes each step's rollouts from (one
class per way of interleaving, in :mod:`.modes` and, for ``stream``, :mod:`.streaming`). Mixed into the RL trainers'
:class:`~posttrain.trainers.trainer_config.RLTrainerConfig`, so the keys sit under ``trainer``. Kept free of heavy
imports: the config tree imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .generation import RolloutSampler, WeightSync
    from .modes import Draw, RolloutSource
    from .streaming import StreamRollouts

MODES = ("sync", "one_step_off", "async", "stream")
STREAM_AHEAD = 2
"""stream: batches queued beyond the one a step trains."""
STALE_POLICIES = ("wait", "drop")
PLACEMENTS = ("colocated", "process")


@dataclass(kw_only=True)
class RolloutModeConfig:
    """When the rollout generates relative to the updates, and how old its samples may be."""

    mode: str = "sync"
    """sync (generate, then train on it, every step), one_step_off (step k+1's rollout is generated while step k
    trains: every sample is one policy version old), async (the rollout runs up to max_staleness versions
    ahead) or stream (agent episodes only: a pool keeps stream_episodes episodes in flight across batches, the
    next batch's starting while this batch's stragglers finish; a step trains the groups that finished first;
    not bitwise reproducible; see :mod:`.streaming`). Only this config reads it (it picks the class :meth:`build_rollout_source` builds); SFT has no such key."""
    max_staleness: int = 1
    """async and stream: the most policy versions a sample may lag the policy it trains (0 reproduces sync bitwise;
    one_step_off is async with 1 and stale_policy=wait)."""
    stale_policy: str = "wait"
    """async: wait (the rollout generates batch j with version j - max_staleness, waiting for it: nothing is
    discarded) or drop (the rollout runs one batch further ahead and a group found staler than max_staleness is
    discarded and replaced by a fresher one: generation is spent to keep the rollout busy). stream ignores it and
    drops: a group staler than max_staleness, as old as its oldest turn, is discarded and replaced."""
    rollout_threads: int = 1
    """one_step_off / async / stream: torch intra-op threads of the rollout's thread (stream: of the episode
    pool's thread; the HF rollout's request thread takes the count of the thread that makes its first request,
    normally the pool's), or of the rollout process with rollout_placement=process (0: torch's default, every
    core). On a CPU, 1 keeps the rollout from oversubscribing the cores the trainer's ops use."""

    stream_episodes: int = 0
    """stream: episodes in flight at most; 0: one batch's episodes (prompts per rank x rollout.n). A prompt's
    group starts when its rollout.n episodes fit (first in, first out); an episode counts from its start to its
    end, its tool waits included."""

    rollout_placement: str = "colocated"
    """colocated (the rollout lives in each trainer process, on the actor's device) or process (one_step_off /
    async only: each trainer rank starts a child process that builds the rollout on its device (the CPU unless
    rollout_devices says otherwise), generates there, and takes weights through the bucketed, checksummed push
    over a private pair of groups; see :mod:`posttrain.trainers.rl.remote`)."""
    rollout_devices: list[str] = field(default_factory=list)
    """rollout_placement=process: the device of each trainer rank's rollout process, indexed by the rank's local
    rank (one entry per process torchrun starts on the node), as the trainer numbers devices: e.g. [cuda:4,
    cuda:5, cuda:6, cuda:7] for trainer ranks on GPUs 0-3, or [cuda:0] for one trainer sharing its GPU with its
    rollout (then give the rollout a memory budget, e.g. rollout.gpu_memory_utilization). Empty: the CPU. A
    rollout on another GPU than its trainer takes the weights over NCCL; on the trainer's GPU or the CPU, through
    host memory over gloo."""

    def check_mode(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"trainer.mode={self.mode!r}: choose one of {', '.join(MODES)}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(
                f"trainer.stale_policy={self.stale_policy!r}: choose one of {', '.join(STALE_POLICIES)}"
            )
        if self.rollout_placement not in PLACEMENTS:
            raise ValueError(
                f"trainer.rollout_placement={self.rollout_placement!r}: choose one of {', '.join(PLACEMENTS)}"
            )
        if self.rollout_placement == "process" and self.mode == "sync":
            raise ValueError(
                "trainer.rollout_placement=process with trainer.mode=sync: a rollout process only pays off when "
                "it generates while the trainer trains; set trainer.mode=one_step_off (or async), or "
                "trainer.rollout_placement=colocated"
            )
        if self.rollout_placement == "process" and self.mode == "stream":
            raise ValueError(
                "trainer.rollout_placement=process with trainer.mode=stream: the episode pool runs in the "
                "trainer's process over a rollout it calls per request; set trainer.rollout_placement=colocated"
            )
        if self.stream_episodes < 0:
            raise ValueError(
                f"trainer.stream_episodes={self.stream_episodes} must be >= 0 (0 = one batch's episodes)"
            )
        if self.stream_episodes and self.mode != "stream":
            raise ValueError(
                f"trainer.stream_episodes={self.stream_episodes} with trainer.mode={self.mode}: only the "
                "stream's episode pool reads it; set trainer.mode=stream or leave trainer.stream_episodes at 0"
            )
        if self.rollout_devices and self.rollout_placement != "process":
            raise ValueError(
                f"trainer.rollout_devices={list(self.rollout_devices)} with trainer.rollout_placement="
                f"{self.rollout_placement}: the devices are those of rollout processes; set "
                "trainer.rollout_placement=process or leave trainer.rollout_devices empty"
            )
        for device in self.rollout_devices:
            if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
                raise ValueError(
                    f"trainer.rollout_devices entry {device!r}: use cpu or cuda:N (N as the trainer numbers GPUs)"
                )
        if self.rollout_threads < 0:
            raise ValueError(
                f"trainer.rollout_threads={self.rollout_threads} must be >= 0 (0 = torch's default)"
            )
        if self.max_staleness < 0:
            raise ValueError(f"trainer.max_staleness={self.max_staleness} must be >= 0 (0 = sync)")

    def check_agent(self, agent: Any) -> None:
        """Refuse stream mode without agent episodes to stream, or without the asynchronous loop whose turns the
        pool plays (``agent`` is the run's :class:`~posttrain.trainers.agents.config.AgentConfig`)."""
        if self.mode != "stream":
            return
        if agent.env is None:
            raise ValueError(
                "trainer.mode=stream streams agent episodes: set agent.env (e.g. agent.env=calculator with "
                "agent.loop=async), or use trainer.mode=async for single-turn rollouts"
            )
        if agent.loop != "async":
            raise ValueError(
                f"trainer.mode=stream with agent.loop={agent.loop}: the pool plays the asynchronous loop's "
                "episodes, one request per turn; set agent.loop=async"
            )

    @property
    def lookahead(self) -> int:
        """Batches the rollout generates ahead of the one being trained (0 in sync mode)."""
        if self.mode == "sync":
            return 0
        if self.mode == "stream":
            return STREAM_AHEAD
        if self.mode == "one_step_off":
            return 1
        return self.max_staleness + (1 if self.stale_policy == "drop" else 0)

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained sample may lag (0 in sync mode)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    def check_estimator(self, estimator: Any) -> None:
        """Refuse what cannot run beside a generating rollout: an estimator that generates inside the step (remax's
        greedy baseline would need the busy rollout)."""
        if self.mode != "sync" and estimator.needs_greedy_baseline:
            raise ValueError(
                f"trainer.mode={self.mode} with an estimator that generates a greedy baseline inside the step "
                "(remax): use trainer.mode=sync or another algorithm.adv_estimator"
            )

    def build_rollout_source(
        self,
        *,
        sampler: RolloutSampler,
        weights: WeightSync,
        draw: Draw,
        replicas: Any,
        prompts_per_rank: int,
        total_steps: int,
        n: int,
        free_cache: bool,
    ) -> RolloutSource | StreamRollouts:
        """The trainer's rollout source: :class:`~.modes.SyncRollouts` for sync, :class:`~.modes.RolloutAhead`
        (generating ``lookahead`` batches ahead on a background thread) for one_step_off and async,
        :class:`~.streaming.StreamRollouts` (the episode pool) for stream."""
        from .modes import RolloutAhead, SyncRollouts

        if self.mode == "sync":
            return SyncRollouts(sampler=sampler, weights=weights, draw=draw, free_cache=free_cache)
        common = dict(
            bound=self.staleness_bound,
            threads=self.rollout_threads,
            sampler=sampler,
            weights=weights,
            draw=draw,
            replicas=replicas,
            prompts_per_rank=prompts_per_rank,
            total_steps=total_steps,
        )
        if self.mode == "stream":
            from .streaming import StreamRollouts

            return StreamRollouts(max_episodes=self.stream_episodes or prompts_per_rank * n, **common)
        return RolloutAhead(lookahead=self.lookahead, n=n, **common)
