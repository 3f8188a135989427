"""torchrun worker (2 ranks: gloo on CPU, NCCL on GPUs): a tiny Qwen3-MoE under expert parallelism equals HF.

Layouts: ``ep2`` (EP=2, so DP=2: each rank trains on half the sequences and the all-to-all dispatcher sends
tokens to the rank holding their experts) and ``tp2_ep2_etp1`` (TP=2 with sequence parallelism for attention,
EP=2 with expert tensor parallelism 1: each rank holds two whole experts). Each is checked against plain HF +
torch on the whole batch: log-probs, then one clipped AdamW step (loss, grad norm, every updated parameter
with the exported per-expert tensors placed into transformers' fused expert parameters). Megatron's
load-balancing loss is set to 0 (``moe_aux_loss_coeff``), so its gradients are the NLL's alone, as in the
reference.

Usage: ``torchrun --nproc-per-node 2 moe_dist_worker.py OUT_DIR``; writes ``OUT_DIR/moe_dist_rank<r>.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from posttrain.core.testing import save_tiny_model

LAYOUTS = {
    "ep2": dict(expert_model_parallel_size=2),
    "tp2_ep2_etp1": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    ),
}


def _as_reference_keys(
    exported: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The exported tensors under the reference's keys: per-expert tensors fill NaN-initialised copies of the
    fused expert parameters, so an expert missing from the export shows up as NaN."""
    from posttrain.rollout_hf.experts import expert_slot

    out = {
        k: torch.full_like(v, math.nan) for k, v in ref.items() if k.endswith(("gate_up_proj", "down_proj"))
    }
    for name, tensor in exported.items():
        slot = expert_slot(name, out)
        if slot is not None:
            slot[1].copy_(tensor)
        else:
            out[name] = tensor
    return out


def _check(name: str, eng, path: str, batch, ref, results: dict) -> None:
    from megatron.core import parallel_state as mpu
    from megatron_cpu import hf_log_probs, nll_loss
    from transformers import AutoModelForCausalLM

    ref_loss, ref_norm, ref_params = ref
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = batch.select(list(range(dp_rank, batch.num_seqs, dp)))  # DP=2: sequences 0, 2 and 1, 3
    with eng.eval_mode():
        out = eng.infer_batch(mine)
    if eng.is_mp_src_rank_with_outputs():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            lp_ref = hf_log_probs(hf, mine)
        lp = out["model_output"]["log_probs"].cpu().double()
        results[f"{name}_logprob_maxdiff"] = float((lp - lp_ref).abs().max())
    with eng.train_mode():
        out = eng.train_batch(mine, nll_loss)
    exported = {k: v.float().cpu() for k, v in eng.get_per_tensor_param()[0]}
    losses = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        losses, sum(out["loss"]) if eng.is_mp_src_rank_with_outputs() else None
    )
    # each data-parallel rank's token-mean loss carries the dp_size factor of the global normalisation
    results[f"{name}_loss_diff"] = abs(sum(x for x in losses if x is not None) / dp - ref_loss)
    if eng.is_mp_src_rank_with_outputs():
        results[f"{name}_grad_norm_rel"] = abs(out["metrics"]["grad_norm"] - ref_norm) / ref_norm
    got = _as_reference_keys(exported, ref_params)
    diffs = [float((got[k] - v).abs().max()) for k, v in ref_params.items()]
    results[f"{name}_param_maxdiff"] = math.inf if any(map(math.isnan, diffs)) else max(diffs)


def main() -> None:
    from megatron.core import parallel_state as mpu
    from megatron_cpu import make_engine, prepare_environment, reference_step, sample_batch

    out_dir = sys.argv[1]
    prepare_environment()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if on_cuda else "gloo")
    rank = torch.distributed.get_rank()
    path = os.path.join(out_dir, "tiny_qwen3_moe")
    if rank == 0:
        save_tiny_model(path, "qwen3_moe")
    torch.distributed.barrier()
    batch = sample_batch()
    ref = reference_step(path, batch, lr=1e-3, clip=1.0)
    results: dict[str, float] = {}
    for name, layout in LAYOUTS.items():
        eng = make_engine(path, override_transformer_config={"moe_aux_loss_coeff": 0.0}, **layout)
        _check(name, eng, path, batch, ref, results)
        with open(os.path.join(out_dir, f"moe_dist_rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
        del eng
        mpu.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
