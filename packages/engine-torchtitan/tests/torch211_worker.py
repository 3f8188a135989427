"""Run by test_torch211.py under torchrun (2 gloo ranks) on a torch made to look like 2.11 for the engine:
without ``torch.distributed.fsdp.DataParallelMeshDims``, hidden before anything imports torchtitan. One FSDP2
step as in dist_worker.py; rank 0 writes the streamed weights, the grad norm and which import path the engine
took. With ``moe`` after the work folder, run as a plain process: the Qwen3-MoE in ``moe/`` takes one step in
one process (the MoE path on 2.11; under a process group it is refused)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed.fsdp

if hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):  # torch 2.11 has no such name
    del torch.distributed.fsdp.DataParallelMeshDims

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_worker import LENGTHS, halves  # noqa: E402
from titan_testing import make_batch, make_engine, pg_loss  # noqa: E402


def moe_one_process(work: Path) -> None:
    eng = make_engine(str(work / "moe"))
    with eng.train_mode():
        out = eng.train_batch(make_batch(LENGTHS), pg_loss)
    result = {
        "params": {k: v.clone() for k, v in eng.get_per_tensor_param()[0]},
        "norm": out["metrics"]["grad_norm"],
        "bare_package": sys.modules["torchtitan.models.qwen3"].__spec__.loader is None,
    }
    torch.save(result, work / "torch211_moe.pt")


def main() -> None:
    work = Path(sys.argv[1])
    if sys.argv[2:] == ["moe"]:
        moe_one_process(work)
        return
    eng = make_engine(str(work / "model"), max_token_len_per_gpu=16)
    mine = halves(make_batch(LENGTHS), eng.get_data_parallel_rank())
    with eng.train_mode():
        out = eng.train_batch(mine, pg_loss)
    stream, _ = eng.get_per_tensor_param()
    params = {k: v.clone() for k, v in stream}
    if dist.get_rank() == 0:
        result = {
            "params": params,
            "norm": out["metrics"]["grad_norm"],
            "titan_fsdp_imported": "torchtitan.distributed.fsdp" in sys.modules,
            "bare_package": sys.modules["torchtitan.models.qwen3"].__spec__.loader is None,
        }
        torch.save(result, work / "torch211.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
