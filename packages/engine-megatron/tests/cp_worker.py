"""torchrun worker for the context-parallel tests: CP=2 against CP=1 (DP=2, the same batch on both ranks) and
against plain HF + torch.

Usage: ``torchrun --nproc-per-node 2 cp_worker.py HF_DIR OUT_DIR DTYPES [JSON engine overrides]`` with DTYPES
a comma-separated list (``float32``, ``bfloat16``). For each dtype: log-probs of five packed sequences of odd
lengths (and, with per-token temperatures, log-probs and entropy; and a value model's values), then one
training step (token-mean NLL, clipped Adam). Rank 0 writes ``OUT_DIR/cp_results.json``:
``{dtype: {name: difference}}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

LENGTHS = (7, 13, 5, 11, 9)


def cp_batches():
    """Five sequences of odd lengths (prompt: 2 tokens), and the same with temperatures and entropy."""
    from posttrain.core.batch import PackedBatch

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]
    masks = [torch.cat([torch.zeros(2), torch.ones(n - 2)]) for n in LENGTHS]
    temps = [0.7 + 0.6 * torch.rand(n, generator=g) for n in LENGTHS]
    plain = PackedBatch.from_sequences(seqs, masks)
    tempered = PackedBatch.from_sequences(
        seqs, masks, fields={"temperature": temps}, meta={"calculate_entropy": True}
    )
    return plain, tempered


def run_layout(hf_path, dtype, cp, batch, tempered, extra):
    """Outputs and one training step of an engine at context_parallel_size=cp (DP fills the rest)."""
    from megatron.core import parallel_state as mpu
    from megatron_cpu import make_engine, nll_loss

    res = {}
    eng = make_engine(hf_path, dtype=dtype, context_parallel_size=cp, **extra)
    res["cp_size"] = mpu.get_context_parallel_world_size()
    with eng.eval_mode():
        res["log_probs"] = eng.infer_batch(batch).get("model_output", {}).get("log_probs")
        out = eng.infer_batch(tempered).get("model_output", {})
        res["temperature_log_probs"], res["entropy"] = out.get("log_probs"), out.get("entropy")
    with eng.train_mode():
        out = eng.train_batch(batch, nll_loss)
    res["loss"] = sum(out["loss"]) if "loss" in out else None
    res["grad_norm"] = out.get("metrics", {}).get("grad_norm")
    res["params"] = {k: v.float().cpu() for k, v in eng.get_per_tensor_param()[0]}
    del eng
    value = make_engine(hf_path, "MegatronValueModelEngine", dtype=dtype, context_parallel_size=cp, **extra)
    with value.eval_mode():
        res["values"] = value.infer_batch(batch).get("model_output", {}).get("values")
    del value
    mpu.destroy_model_parallel()
    return res


def _maxdiff(a, b) -> float:
    return float((a.cpu().double() - b.cpu().double()).abs().max())


def compare(cp1, cp2, hf_lp, ref) -> dict[str, float]:
    """Differences of CP=2 to CP=1 and to the HF reference (outputs live on rank 0 only)."""
    ref_loss, ref_norm, ref_params = ref
    out = {
        "cp1_logprob_vs_hf": _maxdiff(cp1["log_probs"], hf_lp),
        "cp2_logprob_vs_hf": _maxdiff(cp2["log_probs"], hf_lp),
        "cp2_logprob_vs_cp1": _maxdiff(cp2["log_probs"], cp1["log_probs"]),
        "cp2_temperature_logprob_vs_cp1": _maxdiff(
            cp2["temperature_log_probs"], cp1["temperature_log_probs"]
        ),
        "cp2_entropy_vs_cp1": _maxdiff(cp2["entropy"], cp1["entropy"]),
        "cp2_value_vs_cp1": _maxdiff(cp2["values"], cp1["values"]),
        "loss_vs_cp1": abs(cp2["loss"] - cp1["loss"]),
        "loss_vs_hf": abs(cp2["loss"] - ref_loss),
        "grad_norm_rel_vs_cp1": abs(cp2["grad_norm"] - cp1["grad_norm"]) / cp1["grad_norm"],
        "grad_norm_rel_vs_hf": abs(cp2["grad_norm"] - ref_norm) / ref_norm,
        "param_maxdiff_vs_cp1": max(_maxdiff(cp2["params"][k], v) for k, v in cp1["params"].items()),
        "param_maxdiff_vs_hf": max(_maxdiff(cp2["params"][k], v) for k, v in ref_params.items()),
    }
    out.update(
        {f"cp{n}_{k}": res[k] for n, res in ((1, cp1), (2, cp2)) for k in ("loss", "grad_norm", "cp_size")}
    )
    return out


def main() -> None:
    from megatron_cpu import hf_log_probs, prepare_environment, reference_step
    from transformers import AutoModelForCausalLM

    hf_path, out_dir, dtypes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    prepare_environment()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if on_cuda else "gloo")
    batch, tempered = cp_batches()
    ref = reference_step(hf_path, batch, lr=1e-3, clip=1.0)
    with torch.no_grad():
        hf_lp = hf_log_probs(AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32), batch)
    results = {}
    for dtype in dtypes:
        cp1 = run_layout(hf_path, dtype, 1, batch, tempered, extra)
        cp2 = run_layout(hf_path, dtype, 2, batch, tempered, extra)
        if torch.distributed.get_rank() == 0:
            results[dtype] = compare(cp1, cp2, hf_lp, ref)
            with open(os.path.join(out_dir, "cp_results.json"), "w") as f:
                json.dump(results, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
