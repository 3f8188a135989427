"""torchrun worker of test_ckpt_dist.py (2 gloo ranks, FSDP2, TinyLM with tied embeddings).

``save``: train K steps of TinyLM, save (sync) at K with every content item, record the reference state;
continue to N with async saves at every step (host buffers prepared ahead with ``prepare_role``;
max_ckpt_to_keep=1), record the losses and final state of this uninterrupted run.
``resume``: in new processes, load step K from the tracker, check model/optimizer/extra against the reference,
train to N and check losses and final parameters bit for bit; load step K into FSDP1 (with and without
``use_orig_params``); then load the async checkpoint of step N.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_testlib import (
    K_STEPS,
    N_STEPS,
    TinyLM,
    assert_identical,
    build,
    full_state,
    rng_equal,
    train_step,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from posttrain.ckpt import (
    CheckpointManager,
    RoleInfo,
    RoleState,
    capture_rng,
    find_latest,
    load_role,
    load_trainer_state,
    prepare_role,
    save_role,
)
from posttrain.core.config import CheckpointConfig

ALL = ["model", "optimizer", "extra", "hf_model"]


def save_phase(out: Path, rank: int, mesh) -> None:
    model, opt, sched = build(None, mesh, tie=True)
    info = RoleInfo(backend="fsdp2", parallel_sizes={"dp": 2, "fsdp": 2})
    losses = [train_step(model, opt, sched, s, rank) for s in range(1, K_STEPS + 1)]
    mgr = CheckpointManager(out / "sync", CheckpointConfig(save_contents=ALL))
    staging = mgr.stage(K_STEPS)
    save_role(
        staging / "actor",
        RoleState(model=model, optimizer=opt, lr_scheduler=sched, counters={"global_step": K_STEPS}),
        info,
        ALL,
        K_STEPS,
    )
    mgr.save_trainer_state(K_STEPS, {"global_step": K_STEPS, "dataloader": {"epoch": 0, "index": K_STEPS}})
    mgr.commit(K_STEPS)
    ref = {"state": full_state(model, opt), "rng": capture_rng(), "sched": sched.state_dict()}
    torch.save(ref, out / f"ref_k_rank{rank}.pt")
    amgr = CheckpointManager(out / "async", CheckpointConfig(async_save=True, max_ckpt_to_keep=1))
    role = RoleState(model=model, optimizer=opt, lr_scheduler=sched)
    prepared = prepare_role(
        "actor", role, ["model", "optimizer", "extra"], amgr.writer
    )  # host DTensor shards
    for s in range(K_STEPS + 1, N_STEPS + 1):
        losses.append(train_step(model, opt, sched, s, rank))
        staging = amgr.stage(s)  # waits for the previous async save
        save_role(
            staging / "actor",
            RoleState(model=model, optimizer=opt, lr_scheduler=sched, counters={"global_step": s}),
            info,
            ["model", "optimizer", "extra"],
            s,
            writer=amgr.writer,
        )
        amgr.commit(s)
        bufs = prepared.result()
        assert bufs and all(amgr.writer.host_buffers[k] is v for k, v in bufs.items()), (
            "prepared buffers unused"
        )
        assert any(isinstance(b, DTensor) for b in bufs.values())
    final = full_state(model, opt)  # taken while the last async write may still run
    amgr.close()
    torch.save({"losses": losses, "state": final}, out / f"ref_n_rank{rank}.pt")


def resume_phase(out: Path, rank: int, mesh) -> None:
    ref_k = torch.load(out / f"ref_k_rank{rank}.pt", weights_only=False)
    ref_n = torch.load(out / f"ref_n_rank{rank}.pt", weights_only=False)
    step, path = find_latest(out / "sync")
    assert step == K_STEPS, step
    model, opt, sched = build(None, mesh, tie=True)
    torch.manual_seed(1234 + rank)  # a different RNG state: load must restore the saved one
    counters = load_role(
        path / "actor",
        RoleState(model=model, optimizer=opt, lr_scheduler=sched),
        ["model", "optimizer", "extra"],
    )
    assert counters == {"global_step": K_STEPS}, counters
    assert load_trainer_state(path)["dataloader"] == {"epoch": 0, "index": K_STEPS}
    assert_identical(full_state(model, opt), ref_k["state"], "state after 2->2 load")
    assert rng_equal(capture_rng(), ref_k["rng"]), "RNG not restored"
    assert sched.state_dict() == ref_k["sched"]
    losses = [train_step(model, opt, sched, s, rank) for s in range(K_STEPS + 1, N_STEPS + 1)]
    for i, loss in enumerate(losses):
        assert torch.equal(loss, ref_n["losses"][K_STEPS + i]), (i, loss, ref_n["losses"][K_STEPS + i])
    assert_identical(full_state(model, opt), ref_n["state"], "final state after resume")
    for orig_params in (True, False):  # FSDP2 -> FSDP1 (FSDP1's flat parameters hide the tie when False)
        model, opt, sched = build_fsdp1(orig_params)
        load_role(path / "actor", RoleState(model=model, optimizer=opt), ["model", "optimizer"])
        assert_identical(full_state(model, opt), ref_k["state"], f"FSDP1 use_orig_params={orig_params}")
    step, path = find_latest(out / "async")
    assert step == N_STEPS and not (out / "async" / f"global_step_{N_STEPS - 1}").exists()
    model, opt, sched = build(None, mesh, tie=True)
    load_role(
        path / "actor",
        RoleState(model=model, optimizer=opt, lr_scheduler=sched),
        ["model", "optimizer", "extra"],
    )
    assert_identical(full_state(model, opt), ref_n["state"], "async checkpoint of step N")


def build_fsdp1(use_orig_params: bool) -> tuple[Any, Any, Any]:
    """The tied TinyLM wrapped whole in FSDP1 on the CPU, its AdamW and LambdaLR (as ``build``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        TinyLM(tie=True), use_orig_params=use_orig_params, device_id=torch.device("cpu")
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    (save_phase if args.phase == "save" else resume_phase)(args.out, rank, mesh)
    dist.barrier()
    (args.out / f"{args.phase}_ok_rank{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
