"""torchrun worker for the 2-rank cross-backend resume: an FSDP checkpoint resumes at TP=2, PP=2 and DP=2.

Runs on 2 gloo CPU ranks, or on 2 GPUs (NCCL) when CUDA is available.

Usage: ``torchrun --nproc-per-node 2 cross_backend_worker.py HF_DIR FSDP_ROLE_DIR OUT_DIR``. For each layout
(TP=2 with sequence parallelism, PP=2, DP=2 with the distributed optimizer) a megatron engine loads the FSDP
engine's role directory (saved after two steps), trains step 3 (at DP=2 each rank takes half the sequences)
and saves a portable checkpoint to ``OUT_DIR/<layout>/actor``. Rank 0 writes ``OUT_DIR/<layout>.pt``: the
step's loss and grad norm and the exported parameters. Then a TP=2 bf16 engine loads the FSDP checkpoint and
saves it again to ``OUT_DIR/tp2_bf16/actor`` at once, and a DP=2 bf16 engine (distributed optimizer) does the
same with ``checkpoint.async_save`` through a background writer: the save must return before the manifest
exists, which appears once the write job ran (the tests compare all of them with the FSDP checkpoint bit for
bit).
:func:`optim` and :func:`batch` are shared with the tests.
"""

from __future__ import annotations

import os
import sys

import torch

LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2": {"use_distributed_optimizer": True},
}
"""Layouts that load the FSDP checkpoint, train step 3 and save."""
ROUND_TRIP = {"tp2_bf16": {"tensor_model_parallel_size": 2, "dtype": "bfloat16"}}
"""Layouts that load the FSDP checkpoint and save it again at once (a bit-exact round trip)."""
ASYNC_ROUND_TRIP = {"dp2_bf16_async": {"use_distributed_optimizer": True, "dtype": "bfloat16"}}
"""The same round trip with an async portable save."""


def optim():
    """AdamW with a 4-step warmup (the LR differs at every step); no weight decay (Megatron exempts biases
    and norms from it, torch's AdamW does not)."""
    from posttrain.core.config import OptimizerConfig

    return OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=4)


def batch(seed: int):
    """Four packed sequences of different lengths; the first two tokens of each are prompt (mask 0)."""
    from posttrain.core.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    lens = [7, 12, 5, 9]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lens]
    masks = [torch.cat([torch.zeros(2), torch.ones(n - 2)]) for n in lens]
    return PackedBatch.from_sequences(seqs, masks)


def _round_trip(name: str, hf_path: str, fsdp_role: str, out_dir: str) -> None:
    from megatron_cpu import make_engine

    eng = make_engine(hf_path, optim=optim(), portable_checkpoint=True, **ROUND_TRIP[name])
    eng.load_checkpoint(fsdp_role)
    eng.save_checkpoint(os.path.join(out_dir, name, "actor"), global_step=2)


def _async_round_trip(name: str, hf_path: str, fsdp_role: str, out_dir: str) -> None:
    """:func:`_round_trip` with an async save; the writer thread is held until the save has returned."""
    import threading

    from megatron_cpu import make_engine

    from posttrain.ckpt import AsyncWriter
    from posttrain.core.config import CheckpointConfig

    ckpt = CheckpointConfig(async_save=True)
    eng = make_engine(hf_path, optim=optim(), ckpt=ckpt, portable_checkpoint=True, **ASYNC_ROUND_TRIP[name])
    eng.load_checkpoint(fsdp_role)
    writer = AsyncWriter(process_group=torch.distributed.new_group(backend="gloo"))
    gate = threading.Event()
    writer.submit(gate.wait)
    role = os.path.join(out_dir, name, "actor")
    eng.save_checkpoint(role, global_step=2, writer=writer)
    torch.distributed.barrier()
    assert not os.path.exists(os.path.join(role, "manifest.json")), "the async save wrote before returning"
    torch.distributed.barrier()
    gate.set()
    writer.close()
    assert os.path.isfile(os.path.join(role, "manifest.json")), "the background write left no manifest"


def _resume(name: str, hf_path: str, fsdp_role: str, out_dir: str) -> None:
    from megatron_cpu import make_engine, nll_loss

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    eng = make_engine(hf_path, optim=optim(), portable_checkpoint=True, **LAYOUTS[name])
    eng.load_checkpoint(fsdp_role)
    step3 = batch(2)
    if name == "dp2":
        step3 = step3.select([rank, rank + 2])
    with eng.train_mode():
        out = eng.train_batch(step3, nll_loss)
        eng.lr_scheduler_step()
    gathered = [None] * world
    has = bool(out) and eng.is_mp_src_rank_with_outputs()
    mine = (sum(out["loss"]), out["metrics"]["grad_norm"]) if has else None
    torch.distributed.all_gather_object(gathered, mine)
    found = [g for g in gathered if g is not None]
    # at DP=2 each rank's token-mean loss carries the dp_size factor of the global normalisation
    loss = sum(g[0] for g in found) / world if name == "dp2" else found[0][0]
    params = {k: v.float().cpu() for k, v in eng.get_per_tensor_param()[0]}
    eng.save_checkpoint(os.path.join(out_dir, name, "actor"), global_step=3)
    if rank == 0:
        result = {"loss": loss, "grad_norm": found[0][1], "lr_step": eng._lr_step, "params": params}
        torch.save(result, os.path.join(out_dir, f"{name}.pt"))


def main() -> None:
    from megatron_cpu import prepare_environment

    hf_path, fsdp_role, out_dir = sys.argv[1:4]
    prepare_environment()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from megatron.core import parallel_state as mpu

    for name in LAYOUTS:
        _resume(name, hf_path, fsdp_role, out_dir)
        mpu.destroy_model_parallel()
    for name in ROUND_TRIP:
        _round_trip(name, hf_path, fsdp_role, out_dir)
        mpu.destroy_model_parallel()
    for name in ASYNC_ROUND_TRIP:
        _async_round_trip(name, hf_path, fsdp_role, out_dir)
        mpu.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
