"""2-rank checks, launched once by test_dist.py under torchrun with gloo: every FSDP layout's step equals the
single-process reference the parent computed, and the LoRA merged stream equals peft's merge_and_unload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_testing import DIST_LENGTHS, case_engine, case_loss, dist_cases, make_batch, max_diff, train_step


def merged_stream_diff(work: Path) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eng = case_engine(dist_cases(work)["fsdp2_lora"])
    stream, peft_cfg = eng.get_per_tensor_param(peft_merge=True, dtype=torch.float32)
    got = dict(stream)
    base = AutoModelForCausalLM.from_pretrained(str(work / "lm"))
    merged = PeftModel.from_pretrained(base, str(work / "adapter")).merge_and_unload()
    want = {k: v for k, v in merged.state_dict().items() if k != "lm_head.weight"}
    assert peft_cfg is None
    return max_diff(got, want)


def main() -> None:
    work = Path(sys.argv[1])
    refs = torch.load(work / "ref.pt")
    batch = make_batch(DIST_LENGTHS)
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    mine = batch.select(list(range(8)) if rank == 0 else list(range(8, len(DIST_LENGTHS))))
    results = {}
    for name, case in dist_cases(work).items():
        got = train_step(case_engine(case), mine, case_loss(case))
        ref = refs[case["ref"]]
        results[name] = {
            "params": max_diff(got["params"], ref["params"]),
            "grads": None if got["grads"] is None else max_diff(got["grads"], ref["grads"]),
            "norm": abs(got["norm"] - ref["norm"]) / ref["norm"],
        }
    results["lora_merged_stream"] = {"params": merged_stream_diff(work)}
    if rank == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
