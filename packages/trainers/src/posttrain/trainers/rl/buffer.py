"""The rollout buffer: prompt groups generated ahead of training, each sample tagged with the policy version
that generated it.

A group is the ``rollout.n`` samples of one prompt with their scores, data sources and reward extras. Groups
leave in the order they were generated. Staleness of a sample trained at step ``k`` is ``k - version`` (the
version is the number of actor updates behind the weights that sampled it). The buffer's ``state_dict`` holds
every group as plain lists and tensors, so a checkpoint carries it and a resumed run trains on the same
samples (peers that lose the buffer on resume: OpenRLHF #1322, TRL #5911).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, fields
from typing import Any

from posttrain.core.rollout import RolloutSample


@dataclass
class Group:
    """The samples of one prompt, as the rollout made and the reward scored them."""

    samples: list[RolloutSample]
    """The prompt's samples (``prompt_index`` is their position in the generation request)."""
    scores: list[float]
    """Reward of each sample."""
    sources: list[str]
    """``data_source`` of each sample."""
    extras: dict[str, list[Any]]
    """Values a reward function returned beside its score, per key, one per sample (None where absent)."""
    versions: list[int]
    """Policy version that generated each sample."""
    epoch: int
    """Epoch of the sampler draw the prompt came from."""

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "samples"}
        out["samples"] = [{f.name: getattr(s, f.name) for f in fields(s)} for s in self.samples]
        return out

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Group:
        samples = [RolloutSample(**s) for s in state["samples"]]
        return cls(**{**state, "samples": samples})


def split_groups(
    samples: list[RolloutSample],
    scores: list[float],
    sources: list[str],
    extras: dict[str, list[Any]],
    *,
    n: int,
    version: int,
    epoch: int,
) -> list[Group]:
    """One generation's samples (grouped by prompt, ``n`` each) -> its groups, all tagged ``version``."""
    out = []
    for start in range(0, len(samples), n):
        part = slice(start, start + n)
        out.append(
            Group(
                samples=samples[part],
                scores=list(scores[part]),
                sources=list(sources[part]),
                extras={k: list(v[part]) for k, v in extras.items()},
                versions=[version] * len(samples[part]),
                epoch=epoch,
            )
        )
    return out


class RolloutBuffer:
    """FIFO of generated groups; counts what it dropped as too stale."""

    def __init__(self) -> None:
        self.groups: deque[Group] = deque()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.groups)

    def extend(self, groups: list[Group]) -> None:
        self.groups.extend(groups)

    def pop(self) -> Group:
        return self.groups.popleft()

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [g.to_dict() for g in self.groups], "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = deque(Group.from_dict(g) for g in state["groups"])
        self.dropped = int(state["dropped"])


def staleness_metrics(groups: list[Group], step: int, bound: int, dropped: int) -> dict[str, float]:
    """``rollout/staleness/{mean,max}`` over the step's samples, ``rollout/staleness/count_<s>`` for every
    staleness ``s`` from 0 to ``bound`` (a histogram, per data-parallel rank), and
    ``rollout/dropped_groups``."""
    ages = [step - v for g in groups for v in g.versions]
    counts = Counter(ages)
    out = {f"rollout/staleness/count_{s}": float(counts.get(s, 0)) for s in range(bound + 1)}
    out["rollout/staleness/mean"] = sum(ages) / max(len(ages), 1)
    out["rollout/staleness/max"] = float(max(ages, default=0))
    out["rollout/dropped_groups"] = float(dropped)
    return out


def merge_groups(groups: list[Group]) -> dict[str, Any]:
    """One step's groups -> samples (``prompt_index`` renumbered to the group's position), scores, sources,
    per-sample reward extras (None where a group lacks a key), the first group's epoch and per-sample
    versions."""
    samples = [dataclasses.replace(s, prompt_index=i) for i, g in enumerate(groups) for s in g.samples]
    keys = sorted({k for g in groups for k in g.extras})
    extras = {k: [v for g in groups for v in g.extras.get(k, [None] * len(g.samples))] for k in keys}
    return {
        "samples": samples,
        "scores": [x for g in groups for x in g.scores],
        "sources": [x for g in groups for x in g.sources],
        "extras": extras,
        "epoch": groups[0].epoch,
        "versions": [v for g in groups for v in g.versions],
    }
