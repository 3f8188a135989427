"""Async save of a Megatron dist_ckpt (torch_dist) on posttrain's background checkpoint writer.

The caller blocks for Megatron-Core's async planning (``dist_checkpointing.save(async_sharded_save=True)``:
the sharding validation, the DCP save plan and the common state, collectives on the default group) and for a
host copy of every tensor this rank writes (the snapshot: training may change the parameters right after). The
file writes and the finalisation then run as one job on :class:`posttrain.ckpt.AsyncWriter`'s thread: the
snapshot is written by Megatron-Core's own writer function, the per-rank write results are gathered and the
global DCP metadata written (Megatron-Core's ``save_state_dict_async_finalize``, but over the writer's gloo
group so the background thread never joins a collective of the training thread), then ``metadata.json``. The
step manager's commit is queued behind that job on the same thread, so the tracker names a checkpoint only
after it is complete. Megatron-Core's own ``AsyncCallsQueue`` is not used: its finalisation runs collectives
on the default group from the training thread, at a point the step manager's commit cannot wait for.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _strategy() -> Any:
    """Megatron-Core's torch_dist save strategy, keeping the plan its async finalisation needs."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class PlanKeepingStrategy(TorchDistSaveShardedStrategy):
        planned: tuple[Any, Any] | None = None

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret, async_strategy):
            self.planned = (writer, save_state_dict_ret[1])  # storage writer, global metadata (rank 0)
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, async_strategy)

    return PlanKeepingStrategy("torch_dist", 1)


def _snapshot(write_buckets: list) -> list:
    """Host copies of the buckets' tensors (always copies: a CPU tensor would otherwise be written live)."""
    out = []
    for path, name, (bytes_data, tensor_data) in write_buckets:
        copies = [(item, tensor.detach().to("cpu", copy=True)) for item, tensor in tensor_data]
        out.append((path, name, (bytes_data, copies)))
    return out


def _finalize(storage_writer: Any, global_metadata: Any, group: Any) -> None:
    """Gather the write results on rank 0, write the DCP metadata there, raise everywhere if any write
    failed."""
    results = storage_writer.retrieve_write_results()
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(results, gathered, dst=0, group=group)
    failed = [None]
    if rank == 0:
        errors = [r for r in gathered if isinstance(r, BaseException) or not isinstance(r, list)]
        failed[0] = repr(errors[0]) if errors else ""
        if not errors:
            storage_writer.finish(global_metadata, gathered)
    dist.broadcast_object_list(failed, src=0, group=group)
    if failed[0]:
        raise RuntimeError(f"async checkpoint write failed on some rank: {failed[0]}")


def _write(request: Any, buckets: list, planned: tuple, ckpt_dir: Path, config: Any, group: Any) -> None:
    from megatron.core.dist_checkpointing.core import save_config

    if request.async_fn is not None:
        args = list(request.async_fn_args)
        args[1] = buckets
        request.async_fn(*args, **request.async_fn_kwargs)
    _finalize(planned[0], planned[1], group)
    if dist.get_rank() == 0:
        save_config(config, str(ckpt_dir))
    dist.barrier(group=group)


def save(sharded: dict[str, Any], ckpt_dir: Path, content_metadata: dict, writer: Any) -> Future:
    """Plan and snapshot ``sharded`` into ``ckpt_dir`` now; queue the writes and finalisation on
    ``writer``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    strategy = _strategy()
    request = dist_checkpointing.save(
        sharded,
        str(ckpt_dir),
        strategy,
        async_sharded_save=True,
        content_metadata=content_metadata,
        async_strategy="mcore",
    )
    buckets = _snapshot(request.async_fn_args[1]) if request.async_fn is not None else []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    config = CheckpointingConfig(strategy.backend, strategy.version)
    return writer.submit(_write, request, buckets, strategy.planned, ckpt_dir, config, writer.process_group)
