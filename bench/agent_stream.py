"""The agent bench's ``stream`` arm: ``trainer.mode=stream``'s episode pool over the bench's batches.

:func:`play_stream` submits ``batches`` batches of the prompts (batch ``b`` samples with seed ``seed + b``, as
the other arms' batches do) to one :class:`~posttrain.trainers.agents.stream.EpisodeStream` capped at one
batch's episodes (or ``--stream-episodes``), then takes one batch's worth of finished groups at a time, in the
order they finish, as the trainer's steps do. Between two takes it pauses the pool as the trainer does around
a weight push (the gate closes, the requests in flight finish, the gate reopens on the next version): the
drain is what a push costs the stream on top of the push itself, which every arm pays alike and the bench
leaves out. A group's staleness is the number of pushes between its oldest turn and its take. No training runs
between takes, so the pool never waits for a trainer: this measures the loop, like the other arms.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def play_stream(
    agent: Any, rollout: Any, prompts: list, sampling: Any, batches: int, cap: int = 0
) -> tuple[list, dict]:
    """([(batch, episode)] of every taken group, the pool's metrics over the run); ``cap``: episodes in flight
    at most (``trainer.stream_episodes``; 0: one batch's)."""
    from posttrain.trainers.agents.stream import EpisodeStream

    stream = EpisodeStream(agent, rollout, max_episodes=cap or len(prompts) * sampling.n)
    played: list = []
    staleness: list[int] = []
    try:
        for b in range(batches):
            stream.submit(b, prompts, dataclasses.replace(sampling, seed=sampling.seed + b), epoch=0)
        for b in range(batches):  # take b happens while version b is served
            for g in stream.take(len(prompts)):
                played += [(g.batch, e) for e in g.episodes]
                staleness.append(b - min(g.versions))
            if b < batches - 1:
                with stream.paused(version=b + 1):
                    pass  # the trainer's weight push runs here
        metrics = stream.metrics()
    finally:
        stream.close()
    metrics["staleness_mean"] = sum(staleness) / len(staleness)
    metrics["staleness_max"] = max(staleness)
    return played, metrics


def stream_arms(caps: list[int] | None) -> list[str]:
    """One stream arm per ``--stream-episodes`` cap: ``stream`` for 0 (one batch's episodes), ``streamN`` for
    N."""
    names = [f"stream{c}" if c else "stream" for c in (caps or [0])]
    bad = [c for c in caps or [] if c < 0]
    if bad or len(set(names)) < len(names):
        raise ValueError(
            f"--stream-episodes {caps}: give each cap once, as 0 (one batch's episodes) or a positive number"
        )
    return names


def stream_cap(arm: str) -> int:
    """The cap of stream arm ``arm`` (0: one batch's)."""
    return int(arm.removeprefix("stream") or 0)
