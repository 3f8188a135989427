"""torchrun worker for the 2-rank LoRA test: a TP=2 (sequence parallel) LoRA engine against HF + peft.

Usage: ``torchrun --nproc-per-node 2 lora_worker.py HF_DIR OUT_DIR``. After one training step, rank 0 loads the
adapter stream into peft on the HF model and writes ``OUT_DIR/results.json``: the largest differences between
the engine's log-probs and peft's, between the merged stream and peft's ``merge_and_unload``, and between the
engine inside ``disable_adapter()`` and the HF base model; plus how far the adapter moves the log-probs.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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
    return model


def main(hf_path: str, out_dir: str) -> None:
    from megatron_cpu import hf_log_probs, nll_loss, prepare_environment, sample_batch
    from test_lora import make_lora_engine

    prepare_environment()
    torch.distributed.init_process_group("gloo")
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False  # see test_lora.lora_env
    batch = sample_batch()
    eng = make_lora_engine(hf_path, tensor_model_parallel_size=2, sequence_parallel=True)
    with eng.train_mode():
        eng.train_batch(batch, nll_loss)
    ours = _log_probs(eng, batch)
    with eng.disable_adapter():
        ours_base = _log_probs(eng, batch)
    stream, config = eng.get_per_tensor_param(base_sync_done=True)
    adapter = {k: v.cpu() for k, v in stream}
    merged = {k: v.cpu() for k, v in eng.get_per_tensor_param(peft_merge=True)[0]}
    if torch.distributed.get_rank() == 0:
        model = _peft_reference(hf_path, adapter, config)
        with torch.no_grad():
            ref = hf_log_probs(model, batch)
            with model.disable_adapter():
                ref_base = hf_log_probs(model, batch)
        ref_merged = model.merge_and_unload().state_dict()
        results = {
            "logprob_maxdiff": float((ours - ref).abs().max()),
            "base_logprob_maxdiff": float((ours_base - ref_base).abs().max()),
            "adapter_effect": float((ref - ref_base).abs().max()),
            "merged_maxdiff": max(float((merged[k] - v).abs().max()) for k, v in ref_merged.items()),
            "merged_names_equal": sorted(merged) == sorted(ref_merged),
        }
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
