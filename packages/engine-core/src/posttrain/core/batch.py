"""The packed-batch contract every engine consumes.

Variable-length sequences are concatenated into one stream with no padding. Sequence ``i`` occupies tokens
``cu_seqlens[i]:cu_seqlens[i+1]``; ``position_ids`` restart at 0 in each sequence. Every per-token field is
aligned with the token it describes: ``loss_mask[t] = 1`` means token ``t`` is a training target, and engines
return ``log_probs[t] = log p(input_ids[t] | tokens before t in its sequence)``, 0 for a sequence's first
token.

Micro-batching splits the sequences of a batch into partitions (by count, or by a token budget with balanced
partitions) and puts the outputs back in the caller's order. The number of loss tokens across all
micro-batches and data-parallel ranks travels in :class:`LossContext`, so a token-mean loss is the same under
any layout.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

TOKEN_FIELDS_REQUIRED = ("input_ids", "position_ids", "loss_mask")


@dataclass
class PackedBatch:
    """A batch of variable-length sequences packed end to end (shapes: T = total tokens, B = sequences)."""

    input_ids: torch.Tensor
    """(T,) int64 token ids."""
    position_ids: torch.Tensor
    """(T,) int64 positions, restarting at 0 in each sequence."""
    cu_seqlens: torch.Tensor
    """(B+1,) int32 cumulative sequence lengths starting at 0."""
    loss_mask: torch.Tensor
    """(T,) float32: 1 where the token is a training target."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra per-token tensors, first dimension T: (T,) temperature, old_log_probs, ref_log_probs, advantages,
    returns, values...; (T, layers, k) int routed_experts (MoE router replay). :meth:`select` and :meth:`to`
    carry every field along its first dimension."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Non-tensor options, e.g. ``calculate_entropy``."""
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-sequence (B,) tensors: uid (prompt group), score, ..."""
    host_cu_seqlens: list[int] | None = field(default=None, repr=False, compare=False)
    """``cu_seqlens`` as Python ints (read from the tensor on construction; :meth:`to` hands it to the batch
    on an accelerator, whose lengths are then read without a host-device sync). Leave it None; do not edit
    ``cu_seqlens`` of a device batch in place."""

    def __post_init__(self) -> None:
        total = self.input_ids.numel()
        if self.input_ids.dim() != 1:
            raise ValueError(
                f"PackedBatch.input_ids must be 1-D (packed), got shape {tuple(self.input_ids.shape)}"
            )
        if self.cu_seqlens.dim() != 1 or self.cu_seqlens.numel() < 1:
            raise ValueError("PackedBatch.cu_seqlens must be 1-D and start at 0")
        if self.host_cu_seqlens is None or self.cu_seqlens.device.type == "cpu":  # trusted on devices only
            self.host_cu_seqlens = [int(c) for c in self.cu_seqlens.tolist()]
        cu = self.host_cu_seqlens
        if len(cu) != self.cu_seqlens.numel() or cu[0] != 0:
            raise ValueError("PackedBatch.cu_seqlens must be 1-D and start at 0")
        if cu[-1] != total:
            raise ValueError(f"PackedBatch.cu_seqlens ends at {cu[-1]} but there are {total} tokens")
        for name, t in [
            ("position_ids", self.position_ids),
            ("loss_mask", self.loss_mask),
            *self.fields.items(),
        ]:
            if t.shape[0] != total:
                raise ValueError(
                    f"PackedBatch field {name!r} has {t.shape[0]} entries, expected {total} (one per token)"
                )
        for name, t in self.seq_fields.items():
            if t.shape[0] != self.num_seqs:
                raise ValueError(
                    f"PackedBatch seq_field {name!r} has {t.shape[0]} entries, expected {self.num_seqs} "
                    "(one per sequence)"
                )

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        loss_masks: Sequence[Sequence[float] | torch.Tensor] | None = None,
        fields: dict[str, Sequence[Sequence[float] | torch.Tensor]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> PackedBatch:
        """Pack lists of token ids (and matching per-token lists) into one batch."""
        if len(sequences) == 0:
            raise ValueError("PackedBatch.from_sequences needs at least one sequence")
        ids = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
        lens = [len(s) for s in ids]
        if min(lens) == 0:
            raise ValueError(f"sequence {lens.index(0)} is empty: every sequence needs at least one token")
        cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        pos = torch.cat([torch.arange(n) for n in lens])
        masks = loss_masks if loss_masks is not None else [torch.ones(n) for n in lens]
        packed = {
            k: torch.cat([torch.as_tensor(v, dtype=torch.float32) for v in vals])
            for k, vals in (fields or {}).items()
        }
        return cls(
            torch.cat(ids),
            pos,
            cu,
            torch.cat([torch.as_tensor(m, dtype=torch.float32) for m in masks]),
            packed,
            dict(meta or {}),
        )

    # ---------------------------------------------------------------- views
    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def seqlens(self) -> list[int]:
        cu = self.host_cu_seqlens
        return [b - a for a, b in zip(cu[:-1], cu[1:])]  # type: ignore[index]

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-token tensor by name."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "loss_mask": self.loss_mask,
            **self.fields,
        }

    def seq_index(self) -> torch.Tensor:
        """(T,) int64: which sequence each token belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.num_seqs, device=self.cu_seqlens.device),
            (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long(),
            output_size=self.num_tokens,
        )

    def select(self, indices: Sequence[int]) -> PackedBatch:
        """A new batch of the sequences ``indices`` in that order."""
        cu = self.host_cu_seqlens
        token_idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in indices]).to(self.input_ids.device)
        lens = torch.tensor([cu[i + 1] - cu[i] for i in indices])
        new_cu = torch.zeros(len(indices) + 1, dtype=torch.int32)
        new_cu[1:] = torch.cumsum(lens, 0)
        tensors = {k: v.index_select(0, token_idx.to(v.device)) for k, v in self.token_tensors().items()}
        return PackedBatch(
            tensors.pop("input_ids"),
            tensors.pop("position_ids"),
            new_cu.to(self.cu_seqlens.device),
            tensors.pop("loss_mask"),
            tensors,
            dict(self.meta),
            {
                k: v.index_select(0, torch.as_tensor(list(indices), device=v.device))
                for k, v in self.seq_fields.items()
            },
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """This batch on ``device``. ``non_blocking``: host tensors are pinned and copied asynchronously, so
        moving a batch to a GPU does not wait for the work already queued there."""
        device = torch.device(device)
        pin = non_blocking and device.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            if pin and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        return PackedBatch(
            move(self.input_ids),
            move(self.position_ids),
            move(self.cu_seqlens),
            move(self.loss_mask),
            {k: move(v) for k, v in self.fields.items()},
            dict(self.meta),
            {k: move(v) for k, v in self.seq_fields.items()},
            host_cu_seqlens=self.host_cu_seqlens,
        )

    def split_tokens(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Split a (T, ...) tensor aligned with this batch into one tensor per sequence."""
        return list(torch.split(packed, self.seqlens))


@dataclass(frozen=True)
class LossContext:
    """Global counts a loss needs to be invariant to micro-batching and data parallelism.

    A token-mean loss is ``sum(loss * mask) / global_num_tokens * dp_size`` on each micro-batch: summing the
    micro-batch gradients and averaging them over ``dp_size`` ranks then gives the mean over all tokens.
    """

    global_num_tokens: int
    """Loss tokens (sum of loss_mask) in the whole step, over every micro-batch and data-parallel rank."""
    global_num_seqs: int
    """Sequences in the whole step over every data-parallel rank."""
    dp_size: int
    """Data-parallel ranks whose gradients are averaged."""


LossFn = Callable[[dict[str, torch.Tensor], PackedBatch, LossContext], tuple[torch.Tensor, dict[str, Any]]]
"""``loss_fn(model_output, micro_batch, ctx) -> (scalar loss, metrics)``; model_output holds (T,) tensors."""


def _balanced_bins(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Longest-first greedy partition of ``lengths`` into ``num_bins`` bins of near-equal token sums."""
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins if b]


def partition_by_tokens(lengths: Sequence[int], max_tokens: int, min_num_bins: int = 1) -> list[list[int]]:
    """Split sequence indices into the fewest balanced partitions (at least ``min_num_bins``) of at most
    ``max_tokens`` tokens each."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the micro-batch token budget {max_tokens}: raise "
            f"max_token_len_per_gpu to at least {longest} or shorten the data"
        )
    num_bins = max(min_num_bins, -(-sum(lengths) // max_tokens))
    while True:
        bins = _balanced_bins(lengths, min(num_bins, len(lengths)))
        if all(sum(lengths[i] for i in b) <= max_tokens for b in bins) and len(bins) >= min(
            min_num_bins, len(lengths)
        ):
            return bins
        num_bins += 1


def partition_by_count(num_seqs: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` sequences."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size_per_gpu={micro_batch_size} must be positive")
    return [list(range(i, min(i + micro_batch_size, num_seqs))) for i in range(0, num_seqs, micro_batch_size)]


def _collective_device(group: Any) -> torch.device:
    """Where tensors must live for a collective on ``group`` (NCCL: the current GPU; gloo: the CPU)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_micro_batches(
    batch: PackedBatch,
    *,
    max_tokens: int | None,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    dp_group: Any = None,
) -> list[list[int]]:
    """Partitions of ``batch``'s sequences; with a process group every rank gets the same partition count
    (ranks with fewer sequences than partitions get fewer, and the engine must still step in lockstep)."""
    lengths = batch.seqlens
    if use_dynamic_bsz:
        if max_tokens is None:
            raise ValueError(
                "use_dynamic_bsz=true needs max_token_len_per_gpu (e.g. engine.max_token_len_per_gpu=8192)"
            )
        parts = partition_by_tokens(lengths, max_tokens)
        if dp_group is not None and torch.distributed.is_initialized():
            n = torch.tensor([len(parts)], device=_collective_device(dp_group))
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=dp_group)
            if int(n) != len(parts):
                parts = partition_by_tokens(lengths, max_tokens, min_num_bins=int(n))
        return parts
    if micro_batch_size is None:
        return [list(range(batch.num_seqs))]
    return partition_by_count(batch.num_seqs, micro_batch_size)


def restore_order(
    parts: Sequence[Sequence[int]], micro_batches: Sequence[PackedBatch], outputs: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Concatenate per-micro-batch (T_i, ...) outputs back into the original sequence order."""
    per_seq: dict[int, torch.Tensor] = {}
    for idx, mb, out in zip(parts, micro_batches, outputs):
        for i, piece in zip(idx, mb.split_tokens(out)):
            per_seq[i] = piece
    return torch.cat([per_seq[i] for i in range(len(per_seq))])


def loss_context(batch: PackedBatch, dp_group: Any = None) -> LossContext:
    """Global token and sequence counts of this step, summed over the data-parallel group."""
    counts = torch.tensor([float(batch.loss_mask.sum()), float(batch.num_seqs)], dtype=torch.float64)
    dp_size = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        dp_size = torch.distributed.get_world_size(dp_group)
        if dp_size > 1:
            counts = counts.to(_collective_device(dp_group))
            torch.distributed.all_reduce(counts, group=dp_group)
    return LossContext(int(counts[0].item()), int(counts[1].item()), dp_size)


def check_temperatures(batch: PackedBatch) -> None:
    """Raise unless every temperature of ``batch`` is > 0 (run on the host batch: no device sync)."""
    if "temperature" in batch.fields:
        low = float(batch.fields["temperature"].min()) if batch.num_tokens else 1.0
    else:
        low = float(batch.meta.get("temperature", 1.0))
    if low <= 0:
        raise ValueError(
            f"temperature must be > 0 for log-probs, got min {low}: pass the sampling "
            "temperature (use 1.0 for greedy rollouts)"
        )


def temperatures(mb: PackedBatch) -> torch.Tensor:
    """(T,) temperature of each token: ``fields['temperature']``, else ``meta['temperature']``, else 1.
    Values are checked by :func:`check_temperatures` on the host batch."""
    if "temperature" in mb.fields:
        return mb.fields["temperature"].float()
    return torch.full((mb.num_tokens,), float(mb.meta.get("temperature", 1.0)), device=mb.input_ids.device)


def as_floats(values: list[Any]) -> list[float]:
    """Python floats of scalars and 0-d tensors (an engine's per-micro-batch losses and metrics), with one
    host sync for all the tensors."""
    tensors = [v.detach().float().reshape(()) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def lockstep_count(count: int, dp_size: int, device: torch.device) -> int:
    """The largest micro-batch ``count`` over all ranks (FSDP needs every rank in the same number of passes);
    ``count`` itself when ``dp_size`` is 1. The all-reduce runs on ``device`` under NCCL, else on the CPU."""
    import torch.distributed as dist

    if dp_size == 1:
        return count
    n = torch.tensor([count], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


def run_micro_batches(
    count: int,
    forward: Callable[[int], tuple[PackedBatch, dict[str, torch.Tensor]]],
    loss_fn: LossFn | None,
    ctx: LossContext,
    forward_only: bool,
) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor], dict[str, list[Any]]]:
    """An engine's micro-batch loop: ``forward(i)`` gives micro-batch ``i`` on the device and its per-token
    outputs; the loss (when ``loss_fn``) is backpropagated unless ``forward_only``. Returns the detached
    outputs, the detached losses (read them once, after the loop) and each metric's per-micro-batch values."""
    outputs: list[dict[str, torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    metrics: dict[str, list[Any]] = {}
    for i in range(count):
        mb, out = forward(i)
        if loss_fn is not None:
            loss, mb_metrics = loss_fn(out, mb, ctx)
            if not forward_only:
                loss.backward()
            losses.append(loss.detach())
            for key, value in (mb_metrics or {}).items():
                metrics.setdefault(key, []).append(value)
        outputs.append({k: v.detach() for k, v in out.items()})
    return outputs, losses, metrics
