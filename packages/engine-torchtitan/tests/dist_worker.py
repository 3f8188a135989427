"""Run by test_dist.py under torchrun (2 gloo ranks): one FSDP2 step, each rank on part of the batch; rank 0
writes the streamed weights and the grad norm, and the engine saves a checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from titan_testing import make_batch, make_engine, pg_loss

from posttrain.core.batch import PackedBatch

LENGTHS = [7, 12, 3, 9, 5, 11]


def halves(batch: PackedBatch, rank: int) -> PackedBatch:
    """Rank 0 takes four documents and rank 1 two: unequal micro-batch counts."""
    return batch.select([0, 1, 2, 3] if rank == 0 else [4, 5])


def main() -> None:
    work = Path(sys.argv[1])
    for case in ("fsdp2",):
        eng = make_engine(str(work / "model"), max_token_len_per_gpu=16)
        mine = halves(make_batch(LENGTHS), eng.get_data_parallel_rank())
        with eng.train_mode():
            out = eng.train_batch(mine, pg_loss)
        stream, _ = eng.get_per_tensor_param()
        params = {k: v.clone() for k, v in stream}
        if case == "fsdp2":
            eng.save_checkpoint(str(work / "ckpt" / "global_step_1" / "actor"), global_step=1)
        if dist.get_rank() == 0:
            torch.save({"params": params, "norm": out["metrics"]["grad_norm"]}, work / f"{case}.pt")
        del eng
        dist.barrier()


if __name__ == "__main__":
    main()
