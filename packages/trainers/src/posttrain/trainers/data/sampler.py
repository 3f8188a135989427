"""A resumable sampler: which samples each optimizer step trains on, over epochs.

Epoch ``e`` visits the dataset in the order ``torch.randperm(n, generator=seeded(seed + e))`` (or 0..n-1
without shuffling) and cuts it into consecutive global batches of ``batch_size`` samples; an incomplete last
batch is dropped so every step sees the same number of samples. The state is just ``(epoch, step in epoch)``
plus the numbers that define the order, so a sampler restored from :meth:`state_dict` continues with the next
unseen batch, and a mismatching dataset size, batch size or seed is refused instead of silently reordering.
Each data-parallel rank takes a contiguous slice of the global batch (:func:`rank_slice`).
"""

from __future__ import annotations

from typing import Any

import torch


class StatefulSampler:
    """Global batches of sample indices, epoch after epoch, with a saveable position."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 1) -> None:
        if batch_size > num_samples:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the training set ({num_samples} "
                "samples): lower data.train_batch_size or add data"
            )
        self.num_samples, self.batch_size, self.shuffle, self.seed = num_samples, batch_size, shuffle, seed
        self.epoch = 0
        self.step_in_epoch = 0
        self._order: list[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (the last partial batch is dropped)."""
        return self.num_samples // self.batch_size

    def order(self, epoch: int) -> list[int]:
        """The visiting order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def next_batch(self) -> tuple[int, list[int]]:
        """(epoch, global sample indices) of the next step; moves to the next epoch when one is used up."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
            self._order = None
        if self._order is None:
            self._order = self.order(self.epoch)
        start = self.step_in_epoch * self.batch_size
        self.step_in_epoch += 1
        return self.epoch, self._order[start : start + self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size", "shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's sampler has {key}={state[key]} but this run has "
                    f"{getattr(self, key)}: resume with the same data and data.train_batch_size/"
                    "shuffle/seed, or start fresh (trainer.resume_mode=disable)"
                )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        self._order = None


def rank_slice(indices: list[int], rank: int, world: int) -> list[int]:
    """The contiguous share of ``indices`` that data-parallel ``rank`` of ``world`` trains on."""
    if len(indices) % world:
        raise ValueError(
            f"a batch of {len(indices)} samples does not split over {world} data-parallel ranks: "
            f"make data.train_batch_size a multiple of {world}"
        )
    per = len(indices) // world
    return indices[rank * per : (rank + 1) * per]
