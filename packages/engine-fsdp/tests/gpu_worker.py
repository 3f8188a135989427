"""FSDP2 on CUDA under NCCL (launched by test_gpu.py with one process per GPU, at most two): bf16 log-probs
close to an fp32 HF forward, training steps that apply, the weight stream, and an offload round trip."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from fsdp_testing import make_batch, make_engine, pg_loss


def hf_log_probs(path: str, batch, device: torch.device) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    out = []
    with torch.no_grad():
        for ids, temp in zip(
            batch.split_tokens(batch.input_ids), batch.split_tokens(batch.fields["temperature"])
        ):
            ids = ids.to(device)
            logp = torch.log_softmax(model(ids[None]).logits[0].float() / float(temp[0]), -1)
            lp = torch.zeros(len(ids), device=device)
            lp[1:] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            out.append(lp.cpu())
    return torch.cat(out)


def main() -> None:
    path = sys.argv[1]
    eng = make_engine(
        path,
        dtype="bfloat16",
        strategy="fsdp2",
        max_token_len_per_gpu=512,
        param_offload=True,
        optimizer_offload=True,
    )
    rank = dist.get_rank()
    batch = make_batch([300, 40, 9, 130, 77][rank:], seed=rank)
    with eng.eval_mode():
        got = eng.infer_batch(batch)["model_output"]["log_probs"]
    diff = float((got - hf_log_probs(path, batch, eng.device)).abs().max())
    assert diff < 5e-2, f"bf16 packed log-probs differ from fp32 HF by {diff}"
    for _ in range(2):
        with eng.train_mode():
            metrics = eng.train_batch(batch, pg_loss)["metrics"]
        assert metrics["skipped_step"] == 0.0 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert all(p.device.type == "cpu" for p in eng.module.parameters())
    before = {n: t.float().cpu() for n, t in eng.get_per_tensor_param(dtype=torch.float32)[0]}
    eng.to(eng.device)
    eng.to("cpu")
    eng.to(eng.device)
    after = {n: t.float().cpu() for n, t in eng.get_per_tensor_param(dtype=torch.float32)[0]}
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    stream = dict(eng.get_per_tensor_param(dtype="bfloat16")[0])
    assert all(t.dtype == torch.bfloat16 and t.device.type == eng.device.type for t in stream.values())
    stored = dict(eng.get_per_tensor_param()[0])  # as stored: the fp32 master weights, no cast
    assert all(t.dtype == torch.float32 for t in stored.values())
    print(f"rank {rank}: ok, log-prob diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
