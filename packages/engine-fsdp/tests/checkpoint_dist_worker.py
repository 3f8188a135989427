"""torchrun worker of test_checkpoint_dist.py (2 gloo ranks): an FSDP2 engine trains one step and saves with
every content item; the checkpoint then loads on 2 ranks into a new FSDP2 engine and into an FSDP1 engine, and
both must hold the saved model and optimizer state exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_testing import make_batch, make_engine, pg_loss
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from posttrain.ckpt import CheckpointManager
from posttrain.core.config import CheckpointConfig
from posttrain.fsdp.checkpoint import load_fsdp_checkpoint

CONTENTS = ["model", "optimizer", "extra", "hf_model"]


def engine(path: str, strategy: str):
    eng = make_engine(path, lr=1e-2, strategy=strategy, max_token_len_per_gpu=32)
    eng.checkpoint_config = CheckpointConfig(save_contents=CONTENTS)
    return eng


def full_state(eng) -> dict[str, torch.Tensor]:
    """Gathered model + flattened optimizer state (collective)."""
    msd, osd = get_state_dict(
        eng.module,
        eng.optimizer,
        options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
    )
    out = {f"model.{k}": v for k, v in msd.items()} | {f"optim.{k}": v for k, v in osd.items()}
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def main() -> None:
    work = Path(sys.argv[1])
    path = str(work / "lm")
    eng = engine(path, "fsdp2")
    rank = dist.get_rank()
    with eng.train_mode():
        eng.train_batch(make_batch([5, 9, 3, 17, 11, 7], seed=rank), pg_loss)
        eng.lr_scheduler_step()
    mgr = CheckpointManager(work / "ckpt", eng.checkpoint_config)
    staging = mgr.stage(1)
    eng.save_checkpoint(str(staging / "actor"), global_step=1)
    mgr.commit(1)
    ref = full_state(eng)
    if rank == 0:
        torch.save(ref, work / "ref.pt")
    results = {}
    for strategy in ("fsdp2", "fsdp"):
        fresh = engine(path, strategy)
        counters = load_fsdp_checkpoint(fresh, str(mgr.latest()[1] / "actor"))
        results[strategy] = same(full_state(fresh), ref) and counters["global_step"] == 1
    assert all(results.values()), results
    dist.barrier()
    (work / f"ok_rank{rank}").write_text("ok")


if __name__ == "__main__":
    main()
