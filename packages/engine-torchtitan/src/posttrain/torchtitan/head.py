"""The output layer as a head that returns next-token log-probs (entropy, accuracy), never fp32 logits of a
row.

:class:`StatsHead` replaces torchtitan's ``lm_head`` (same ``weight`` parameter, so weight tying, FSDP units
and names stay as they were). With a :class:`~posttrain.core.token_stats.HeadRequest` set it returns, for
hidden states ``h`` (T, D), targets ``y[t] = input_ids[t+1]`` and inverse temperatures ``1/tau[t+1]``, chunk
by chunk (:func:`posttrain.core.token_stats.next_token_stats`, as the FSDP engine's head)::

    z = (h W^T) / tau            # fp32, one chunk at a time
    log_prob[t] = z[y[t]] - logsumexp(z)
    entropy[t]  = logsumexp(z) - sum(softmax(z) * z)
    correct[t]  = argmax(z) == y[t]     # 1.0 / 0.0, no gradient;
                                        # the first index of the maximum, as torch.argmax

With gradients on and ``checkpoint``, each chunk's fp32 part is recomputed in backward. Under tensor
parallelism the weight is torchtitan's vocabulary shard (``Shard(0)``, tied with the embedding's) and each
rank computes the statistics of its slice: the max, the sum of exponentials, the target's logit and
``sum(p * z)`` are summed over the TP group (:func:`tp_sharding_config`), so no rank holds a whole vocabulary
row; the argmax is the smallest vocabulary index that holds the group's maximum (two one-value-per-row
all-reduces).
:func:`posttrain.core.token_stats.align_to_tokens` moves the statistics onto the token they score (0 at each
document's first token), the convention of the other engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.token_stats import HeadRequest, Stats, local_chunk_fn, next_token_stats
from torchtitan.models.common.linear import Linear


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum in forward; identity in backward. Right only where the sum feeds replicated computation
    (the same on every rank of the group, up to the same loss), never a rank's own slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _chunk_stats_tp(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: torch.Tensor,
    with_entropy: bool,
    with_accuracy: bool,
    *,
    group: Any,
    offset: int,
) -> Stats:
    """:func:`~posttrain.core.token_stats.chunk_stats` of logits whose last dim is the vocabulary slice
    ``[offset, offset + V_local)``."""
    z = logits.float() * inv_temp.unsqueeze(-1)
    top = z.detach().amax(-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(z - top.unsqueeze(-1))
    sum_exp = _SumOverGroup.apply(exp.sum(-1), group)
    lse = top + sum_exp.log()
    local = targets - offset
    mine = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    log_prob = _SumOverGroup.apply(picked, group) - lse
    correct = _tp_argmax_hits(logits.detach(), targets, group, offset) if with_accuracy else None
    if not with_entropy:
        return log_prob, None, correct
    # Reduced values only feed replicated terms (that is what the identity backward assumes).
    p_dot_z = _SumOverGroup.apply((exp * z).sum(-1), group) / sum_exp
    return log_prob, lse - p_dot_z, correct


def _tp_argmax_hits(logits: torch.Tensor, targets: torch.Tensor, group: Any, offset: int) -> torch.Tensor:
    """1.0 where ``targets`` is the smallest vocabulary index holding the maximum of its row over the
    group."""
    values, index = logits.max(dim=-1)
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    first = torch.where(values == best, index + offset, torch.iinfo(torch.long).max)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    return first.eq(targets).float()


def tp_sharding_config() -> Any:
    """The output layer under TP: torchtitan's vocabulary-sharded weight (as the tied embedding's), the
    replicated hidden states as local tensors (their gradient a partial sum over the TP group), and the
    statistics, whole on every rank, as output."""
    import spmd_types as spmd

    from torchtitan.models.common.decoder_sharding import dense_activation_placement, dense_param_placement
    from torchtitan.protocols.sharding import LocalMapConfig, ShardingConfig

    whole = dense_activation_placement(tp=spmd.R)
    return ShardingConfig(
        state_shardings={"weight": dense_param_placement(tp=spmd.S(0))},
        in_src_shardings={"hidden": whole},
        in_dst_shardings={"hidden": whole},
        out_src_shardings=whole,
        local_map=LocalMapConfig(in_grad_placements=(dense_activation_placement(tp=spmd.P),)),
    )


class StatsHead(Linear):
    """torchtitan ``Linear`` that returns (T, 1 to 3) [log_prob, entropy?, correct?] while :attr:`request` is
    set."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.request: HeadRequest | None = None
        self.use_compile = False
        """Compile the per-chunk function on first use on CUDA (``engine.use_torch_compile``)."""
        self._stats_fn: Any = None
        self.tp_group: Any = None
        """The tensor-parallel group once :meth:`parallelize` ran on a mesh with a ``tp`` axis."""

    def parallelize(self, parallel_dims: Any) -> None:
        tp_mesh = parallel_dims.get_optional_mesh("tp")
        if tp_mesh is not None:
            self.tp_group = tp_mesh.get_group("tp")
        super().parallelize(parallel_dims)

    def _chunk_fn(self, device: torch.device) -> Any:
        if self.tp_group is not None:
            rows = -(-self.weight.shape[0] // dist.get_world_size(self.tp_group))
            return partial(_chunk_stats_tp, group=self.tp_group, offset=dist.get_rank(self.tp_group) * rows)
        if self._stats_fn is None:
            self._stats_fn = local_chunk_fn(device, self.use_compile)
        return self._stats_fn

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            if self.tp_group is not None:
                raise ValueError("the tensor-parallel output layer returns log-probs only: set a HeadRequest")
            return super().forward(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        weight = self.weight.to_local() if self.tp_group is not None else self.weight
        return next_token_stats(flat, weight, self.bias, self.request, self._chunk_fn(flat.device))
