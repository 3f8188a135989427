"""torchrun worker for the 2-rank LoRA tests: LoRA engines at TP=2 (sequence parallel) and PP=2 against
HF + peft.

Usage: ``torchrun --nproc-per-node 2 lora_worker.py HF_DIR OUT_DIR``. For each layout, after one training
step, the rank that holds the outputs (TP rank 0 of the last pipeline stage) loads the adapter stream into
peft on the HF model and records the largest differences between the engine's log-probs and peft's, between
the merged stream and peft's ``merge_and_unload``, and between the engine inside ``disable_adapter()`` and the
HF base model; plus how far the adapter moves the log-probs, the layers the adapter stream covers and whether
every rank streamed the same names and config. The layouts: TP=2, PP=2, and PP=2 adapting only a layer of the
second stage (the first stage trains nothing, its gradient clipping must still meet the other's collectives).
Each rank writes ``OUT_DIR/results_rank<r>.json`` ({layout: ...}).
"""

from __future__ import annotations

import json
import os
import sys

import torch

LAYOUTS = {
    "tp2": (dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "pp2": (dict(pipeline_model_parallel_size=2), {}),
    # only layer 1's down_proj: the first stage holds no adapter and trains nothing
    "pp2_idle_stage": (
        dict(pipeline_model_parallel_size=2),
        dict(target_modules=["model.layers.1.mlp.down_proj"]),
    ),
}
"""layout name -> (engine config overrides, model config overrides)."""


def _log_probs(eng, batch):
    with eng.eval_mode():
        out = eng.infer_batch(batch)
    return out["model_output"]["log_probs"].cpu().double() if eng.is_mp_src_rank_with_outputs() else None


def _peft_reference(hf_path, adapter, config):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32), LoraConfig(**config)
    )
    result = set_peft_model_state_dict(model, adapter)
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if ".lora_" in k], result.missing_keys
    return model


def _same_on_all_ranks(value) -> bool:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return all(g == gathered[0] for g in gathered)


def _compare(hf_path, batch, eng) -> dict | None:
    """Train one step, stream the adapter and the merged weights (every rank), compare on the output rank."""
    from megatron_cpu import hf_log_probs, nll_loss

    with eng.train_mode():
        eng.train_batch(batch, nll_loss)
    ours = _log_probs(eng, batch)
    with eng.disable_adapter():
        ours_base = _log_probs(eng, batch)
    stream, config = eng.get_per_tensor_param(base_sync_done=True)
    adapter = {k: v.cpu() for k, v in stream}
    merged = {k: v.cpu() for k, v in eng.get_per_tensor_param(peft_merge=True)[0]}
    same = _same_on_all_ranks(
        (sorted(adapter), sorted(merged), json.dumps(config, sort_keys=True, default=str))
    )
    trains = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        trains, any(p.requires_grad for c in eng.chunks for p in c.parameters())
    )
    if ours is None:
        return None
    model = _peft_reference(hf_path, adapter, config)
    with torch.no_grad():
        ref = hf_log_probs(model, batch)
        with model.disable_adapter():
            ref_base = hf_log_probs(model, batch)
    ref_merged = model.merge_and_unload().state_dict()
    return {
        "logprob_maxdiff": float((ours - ref).abs().max()),
        "base_logprob_maxdiff": float((ours_base - ref_base).abs().max()),
        "adapter_effect": float((ref - ref_base).abs().max()),
        "merged_maxdiff": max(float((merged[k] - v).abs().max()) for k, v in ref_merged.items()),
        "merged_names_equal": sorted(merged) == sorted(ref_merged),
        "adapter_layers": sorted({int(k.split(".layers.")[1].split(".")[0]) for k in adapter}),
        "same_streams_on_all_ranks": same,
        "ranks_with_trainable_params": [rank for rank, t in enumerate(trains) if t],
    }


def main(hf_path: str, out_dir: str) -> None:
    from megatron_cpu import prepare_environment, sample_batch
    from test_lora import make_lora_engine

    prepare_environment()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state as mpu

    results = {}
    for layout, (engine_kw, model_kw) in LAYOUTS.items():
        eng = make_lora_engine(hf_path, model_kw=model_kw, **engine_kw)
        found = _compare(hf_path, sample_batch(), eng)
        if found is not None:
            results[layout] = found
        with open(os.path.join(out_dir, f"results_rank{torch.distributed.get_rank()}.json"), "w") as f:
            json.dump(results, f, indent=1)  # what this rank has so far (a later failure keeps it)
        del eng
        mpu.destroy_model_parallel()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
