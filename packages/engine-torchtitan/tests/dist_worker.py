"""Run by test_dist.py under torchrun (2 gloo ranks). ``fsdp2``: one FSDP2 step, each rank on part of the
batch; the engine saves a checkpoint. ``tp``: tensor parallelism over both ranks (one data-parallel rank), the
whole batch on each; rank 0 also writes the log-probs before the step, and ``correct`` (token accuracy) of the
sequences in ``acc_seqs.pt`` when the test wrote them. ``ep``: the Qwen3-MoE model in ``moe/`` with expert
parallelism over both ranks (FSDP2 of the rest), each rank on part of the batch, gradients recorded. Rank 0
writes the streamed weights, grad norm and loss."""

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


def full_grads(eng) -> dict[str, torch.Tensor]:
    """Every gradient, whole, by HF name (collective)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in eng.hf_module.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return grads


def _step_with_grads(eng, batch: PackedBatch, result: dict) -> dict:
    """``train_batch`` with the gradients recorded between backward and the update."""
    eng.optimizer_zero_grad()
    out = eng.forward_backward_batch(batch, pg_loss)
    result["grads"] = full_grads(eng)
    out["metrics"]["grad_norm"] = eng.optimizer_step()
    return out


def main() -> None:
    work = Path(sys.argv[1])
    for case in sys.argv[2:]:
        sizes = {"tp_size": 2} if case == "tp" else {"ep_size": 2} if case == "ep" else {}
        model = work / ("moe" if case == "ep" else "model")
        eng = make_engine(str(model), max_token_len_per_gpu=16, **sizes)
        batch = make_batch(LENGTHS)
        mine = batch if case == "tp" else halves(batch, eng.get_data_parallel_rank())
        result = {"dp": eng.get_data_parallel_size(), "src": eng.is_mp_src_rank_with_outputs()}
        if case == "tp":
            with eng.eval_mode():
                result["log_probs"] = eng.infer_batch(batch)["model_output"]["log_probs"]
                if (work / "acc_seqs.pt").exists():
                    seqs = torch.load(work / "acc_seqs.pt")
                    acc = PackedBatch.from_sequences(seqs, [torch.ones(len(s)) for s in seqs])
                    acc.meta["calculate_accuracy"] = True
                    result["correct"] = eng.infer_batch(acc)["model_output"]["correct"]
        with eng.train_mode():
            out = eng.train_batch(mine, pg_loss) if case == "fsdp2" else _step_with_grads(eng, mine, result)
        if case == "ep":
            experts = eng.hf_module.get_submodule("model.layers.0.mlp.experts").w1_EFD
            result["local_experts"] = experts.to_local().shape[0]  # 4 experts over ep=2, efsdp=1
            result["expert_mesh"] = experts.device_mesh.mesh_dim_names
        stream, _ = eng.get_per_tensor_param()
        result["params"] = {k: v.clone() for k, v in stream}
        if dist.get_rank() == 0:
            result |= {"norm": out["metrics"]["grad_norm"], "loss": out["metrics"]["pg_loss"]}
        if case == "fsdp2":
            eng.save_checkpoint(str(work / "ckpt" / "global_step_1" / "actor"), global_step=1)
        if dist.get_rank() == 0:
            torch.save(result, work / f"{case}.pt")
        del eng
        dist.barrier()
    # without it, a rank's exit could tear gloo's threads down while joinable: "terminate called without an
    # active exception", SIGABRT, after the work had passed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
