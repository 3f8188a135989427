"""torchrun worker for the Megatron-FSDP checkpoint test (CUDA only: Megatron-FSDP allocates CUDA streams).

``torchrun --nproc-per-node 2 fsdp_ckpt_worker.py save HF_DIR OUT_DIR``: data-parallel size 2, one training
step, save to ``OUT_DIR/ckpt``, a second step (the reference), then a fresh engine loads the checkpoint and
must hold the same parameters and Adam moments and take the same second step. ``--nproc-per-node 1 ... load1
HF_DIR OUT_DIR``: the same checkpoint loaded at data-parallel size 1 (resharding), then the second step over
the whole batch. Each run writes ``OUT_DIR/<phase>_results.json``; the reference tensors go to
``OUT_DIR/*.pt``.
``FSDP_CKPT_DTYPE=bfloat16`` runs the engines in bfloat16 (default float32).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch


def _engine(hf_path):
    from megatron_cpu import make_engine

    dtype = os.environ.get("FSDP_CKPT_DTYPE", "float32")  # bfloat16 wraps the model in a Float16Module
    return make_engine(hf_path, use_megatron_fsdp=True, use_distributed_optimizer=True, dtype=dtype)


def _params(eng) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in eng.get_per_tensor_param()[0]}


def _moments(eng) -> dict[str, torch.Tensor]:
    """Full Adam moments by parameter name: each rank's flat shard placed at its ``megatron_fsdp_slice``."""
    from posttrain.megatron.fsdp_dtensor import optimizer_state_dict

    chunk = eng.chunks[0]
    chunk.state_dict_for_save_checkpoint()  # the DTensor parameters in place
    state = optimizer_state_dict(chunk, eng.optimizer, is_loading=False)["state"]
    local = {}
    for name, entry in state.items():
        param = chunk.get_parameter(name)
        for key in ("exp_avg", "exp_avg_sq"):
            flat = entry[key].to_local().detach().float().cpu().flatten()
            local[f"{name}.{key}"] = (param.megatron_fsdp_slice.start, flat, tuple(param.shape))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    out = {}
    for key, (_, _, shape) in sorted(local.items()):
        full = torch.zeros(shape).flatten()
        for shard in gathered:
            start, flat, _ = shard[key]
            full[start : start + flat.numel()] = flat
        out[key] = full.view(shape)
    return out


def _step(eng, batch) -> float:
    """One training step on this rank's share of ``batch``; the loss of the whole batch (all ranks)."""
    from megatron_cpu import nll_loss

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = batch.select(list(range(rank, batch.num_seqs, world)))
    with eng.train_mode():
        out = eng.train_batch(mine, nll_loss)
        eng.lr_scheduler_step()
    losses = [None] * world
    torch.distributed.all_gather_object(losses, sum(out["loss"]))
    return sum(losses) / world  # each rank's loss carries the dp_size factor of the global normalisation


def _maxdiff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _log(msg: str) -> None:
    print(f"[rank{torch.distributed.get_rank()}] {msg}", file=sys.stderr, flush=True)


def _save_phase(hf_path, out_dir, batch) -> dict[str, float]:
    eng = _engine(hf_path)
    _step(eng, batch)
    _log("step 1 done")
    eng.save_checkpoint(os.path.join(out_dir, "ckpt"), global_step=1)
    _log("saved")
    p1, m1 = _params(eng), _moments(eng)
    _log("reference taken")
    loss2 = _step(eng, batch)
    p2 = _params(eng)
    if torch.distributed.get_rank() == 0:
        torch.save({"p1": p1, "m1": m1, "p2": p2, "loss2": loss2}, os.path.join(out_dir, "reference.pt"))
    fresh = _engine(hf_path)
    fresh.load_checkpoint(os.path.join(out_dir, "ckpt"))
    _log("loaded")
    res = {"lr_step": fresh._lr_step, "param_maxdiff": _maxdiff(_params(fresh), p1)}
    res["moment_maxdiff"] = _maxdiff(_moments(fresh), m1)
    res["loss2_diff"] = abs(_step(fresh, batch) - loss2)
    res["p2_maxdiff"] = _maxdiff(_params(fresh), p2)
    res["moment_norm"] = float(sum(v.norm() for v in m1.values()))
    return res


def _load1_phase(hf_path, out_dir, batch) -> dict[str, float]:
    ref = torch.load(os.path.join(out_dir, "reference.pt"))
    eng = _engine(hf_path)
    eng.load_checkpoint(os.path.join(out_dir, "ckpt"))
    res = {"lr_step": eng._lr_step, "param_maxdiff": _maxdiff(_params(eng), ref["p1"])}
    res["moment_maxdiff"] = _maxdiff(_moments(eng), ref["m1"])
    res["loss2_diff"] = abs(_step(eng, batch) - ref["loss2"])
    res["p2_maxdiff"] = _maxdiff(_params(eng), ref["p2"])
    return res


def main() -> None:
    from megatron_cpu import prepare_environment, sample_batch

    phase, hf_path, out_dir = sys.argv[1:4]
    faulthandler.dump_traceback_later(int(os.environ.get("WORKER_TIMEOUT_S", "240")), exit=True)
    prepare_environment()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    run = {"save": _save_phase, "load1": _load1_phase}[phase]
    res = run(hf_path, out_dir, sample_batch())
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, f"{phase}_results.json"), "w") as f:
            json.dump(res, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
