"""torchrun worker (2 GPUs): a tiny Qwen3-MoE at EP=2 trains, and router replay (R2) replays what it recorded.

Usage: ``torchrun --nproc-per-node 2 moe_worker.py OUT_DIR``; writes ``OUT_DIR/moe_results.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from posttrain.core.testing import TINY_QWEN3_MOE, save_tiny_model


def main() -> None:
    from megatron_cpu import make_engine, nll_loss, prepare_environment, sample_batch

    from posttrain.core.config import RouterReplayConfig

    out_dir = sys.argv[1]
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    rank = torch.distributed.get_rank()
    path = "/tmp/tiny_qwen3_moe"
    if rank == 0:
        save_tiny_model(path, "qwen3_moe")
    torch.distributed.barrier()
    prepare_environment()
    eng = make_engine(path, expert_model_parallel_size=2, router_replay=RouterReplayConfig(mode="R2"))
    batch = sample_batch().select([rank, rank + 2])
    res: dict[str, object] = {}
    with eng.eval_mode():
        first = eng.infer_batch(batch)["model_output"]
        again = eng.infer_batch(batch)["model_output"]
    routed = first["routed_experts"]
    res["recorded_shape"] = list(routed.shape)
    res["record_deterministic"] = bool(torch.equal(routed, again["routed_experts"]))
    captured: list[torch.Tensor] = []

    def capture(out, micro, ctx):
        captured.append(out["log_probs"].detach().cpu())
        return nll_loss(out, micro, ctx)

    with eng.train_mode():
        batch.fields["routed_experts"] = routed
        eng.forward_backward_batch(batch, capture)
        replayed = torch.cat(captured)
        captured.clear()
        eng.optimizer_zero_grad()
        batch.fields["routed_experts"] = (routed + 1) % TINY_QWEN3_MOE["num_experts"]
        eng.forward_backward_batch(batch, capture)
        shifted = torch.cat(captured)
        eng.optimizer_zero_grad()
        batch.fields["routed_experts"] = routed
        losses = [sum(eng.train_batch(batch, nll_loss)["loss"]) for _ in range(3)]
    order_lp = first["log_probs"].cpu()
    res["replay_logprob_maxdiff"] = float((replayed - order_lp).abs().max())  # one micro-batch of 2 seqs
    res["other_routing_logprob_maxdiff"] = float((shifted - order_lp).abs().max())
    res["losses"] = losses
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, res)
    if rank == 0:
        with open(os.path.join(out_dir, "moe_results.json"), "w") as f:
            json.dump(gathered, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
