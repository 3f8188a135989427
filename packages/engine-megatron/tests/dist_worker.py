"""torchrun worker for the 2-rank tests: TP=2 (sequence parallel), PP=2 and PP=2 x VPP=2 against HF
references.

Usage: ``torchrun --nproc-per-node 2 dist_worker.py HF_DIR OUT_DIR [JSON engine overrides]``. PP=2 x VPP=2
(the interleaved schedule, a 4-layer model) is checked forward-only and training with 2 and 4 micro-batches;
on CUDA, Megatron-FSDP at DP=2 too. Writes ``OUT_DIR/results_rank<r>.json``
(differences to the references) and ``OUT_DIR/tp2_ckpt`` (a TP=2 checkpoint after one step; the same state
saved asynchronously in ``OUT_DIR/tp2_ckpt_async``) with ``OUT_DIR/tp2_params.pt`` (the exported parameters
then).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _check_infer(name, eng, hf_path, batch, results):
    from megatron_cpu import hf_log_probs
    from transformers import AutoModelForCausalLM

    with eng.eval_mode():
        out = eng.infer_batch(batch)
    if eng.is_mp_src_rank_with_outputs():
        hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
        with torch.no_grad():
            lp_ref = hf_log_probs(hf, batch)
        lp = out["model_output"]["log_probs"].cpu().double()
        results[f"{name}_logprob_maxdiff"] = float((lp - lp_ref).abs().max())


def _check(name, eng, hf_path, batch, ref, results, out_dir=None, **kw):
    from megatron_cpu import hf_log_probs, nll_loss
    from transformers import AutoModelForCausalLM

    ref_loss, ref_norm, ref_params = ref
    with eng.eval_mode():
        out = eng.infer_batch(batch)
    if eng.is_mp_src_rank_with_outputs():
        hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
        with torch.no_grad():
            lp_ref = hf_log_probs(hf, batch)
        results[f"{name}_logprob_maxdiff"] = float(
            (out["model_output"]["log_probs"].cpu().double() - lp_ref).abs().max()
        )
    with eng.train_mode():
        out = eng.train_batch(batch, nll_loss)
        if out_dir is not None:
            eng.save_checkpoint(os.path.join(out_dir, "tp2_ckpt"), global_step=1)
    exported = {k: v.cpu() for k, v in eng.get_per_tensor_param()[0]}
    if eng.is_mp_src_rank_with_outputs():
        results[f"{name}_loss_diff"] = abs(sum(out["loss"]) - ref_loss)
        results[f"{name}_grad_norm_rel"] = abs(out["metrics"]["grad_norm"] - ref_norm) / ref_norm
    results[f"{name}_param_maxdiff"] = max(
        float((exported[k] - v).abs().max()) for k, v in ref_params.items()
    )
    if out_dir is not None and torch.distributed.get_rank() == 0:
        torch.save(exported, os.path.join(out_dir, "tp2_params.pt"))


def _check_data_parallel(name, eng, batch, ref, results):
    """Two data-parallel ranks, each with half the sequences, against the reference over the whole batch."""
    from megatron_cpu import nll_loss

    ref_loss, ref_norm, ref_params = ref
    rank = torch.distributed.get_rank()
    half = batch.select([rank, rank + 2])
    with eng.train_mode():
        out = eng.train_batch(half, nll_loss)
    losses = [None, None]
    torch.distributed.all_gather_object(losses, sum(out["loss"]))
    exported = {k: v.float().cpu() for k, v in eng.get_per_tensor_param()[0]}
    # each rank's token-mean loss carries the dp_size factor of the global normalisation
    results[f"{name}_loss_diff"] = abs(sum(losses) / torch.distributed.get_world_size() - ref_loss)
    results[f"{name}_grad_norm_rel"] = abs(out["metrics"]["grad_norm"] - ref_norm) / ref_norm
    results[f"{name}_param_maxdiff"] = max(
        float((exported[k] - v).abs().max()) for k, v in ref_params.items()
    )


def _save_async(eng, path):
    """The same state again through the async path (the step manager's background writer, its gloo group)."""
    from posttrain.ckpt import AsyncWriter

    writer = AsyncWriter(process_group=torch.distributed.new_group(backend="gloo"))
    eng.checkpoint_config.async_save = True  # this engine's config only; the sync save above already ran
    eng.save_checkpoint(path, global_step=1, writer=writer)
    writer.close()
    eng.checkpoint_config.async_save = False


def _dump(out_dir, results):
    """Each rank writes what it has so far (a later failure keeps earlier results)."""
    with open(os.path.join(out_dir, f"results_rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    from megatron_cpu import make_engine, make_tiny_qwen2, prepare_environment, reference_step, sample_batch

    hf_path, out_dir = sys.argv[1], sys.argv[2]
    prepare_environment()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if on_cuda else "gloo")
    from megatron.core import parallel_state as mpu

    batch = sample_batch()
    ref = reference_step(hf_path, batch, lr=1e-3, clip=1.0)
    results: dict[str, float] = {}
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    # 5-token head chunks: the vocab-parallel all-reduces run per chunk and again in the backward recompute
    extra = {"entropy_from_logits_chunk_size": 5, **extra}
    eng = make_engine(hf_path, tensor_model_parallel_size=2, sequence_parallel=True, **extra)
    _check("tp2", eng, hf_path, batch, ref, results, out_dir=out_dir)
    _save_async(eng, os.path.join(out_dir, "tp2_ckpt_async"))
    _dump(out_dir, results)
    del eng
    mpu.destroy_model_parallel()
    eng = make_engine(hf_path, pipeline_model_parallel_size=2, **extra)
    _check("pp2", eng, hf_path, batch, ref, results)
    _dump(out_dir, results)
    if torch.cuda.is_available():
        del eng
        mpu.destroy_model_parallel()
        eng = make_engine(hf_path, use_megatron_fsdp=True, use_distributed_optimizer=True)
        _check_data_parallel("fsdp", eng, batch, ref, results)
        _dump(out_dir, results)
    del eng
    mpu.destroy_model_parallel()
    deep = os.path.join(out_dir, "hf_4_layers")
    if torch.distributed.get_rank() == 0:
        make_tiny_qwen2(deep, num_hidden_layers=4)
    torch.distributed.barrier()
    eng = make_engine(
        deep, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, forward_only=True
    )
    _check_infer("vpp2_infer", eng, deep, batch, results)
    _dump(out_dir, results)
    del eng
    ref_deep = reference_step(deep, batch, lr=1e-3, clip=1.0)
    for name, kw in (("vpp2", {}), ("vpp2_mb4", {"micro_batch_size_per_gpu": 1})):
        eng = make_engine(deep, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, **kw)
        _check(name, eng, deep, batch, ref_deep, results)  # interleaved 1F1B, 2 and 4 micro-batches
        _dump(out_dir, results)
        del eng
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
