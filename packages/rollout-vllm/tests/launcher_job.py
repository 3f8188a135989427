"""Colocated SPMD job for torchrun: the FSDP engine and an external_launcher vLLM in every rank's process.

Each rank trains one step, syncs its full weights into its own vLLM worker (tensors by reference), and checks
greedy tokens and log-probs against the HF model with the trained weights. Prints ``RANK <r> OK`` on success.
"""

from __future__ import annotations

import sys

import torch
from vllm_testing import ROLLOUT_DTYPE, check_greedy, engine_weights, hf_model, make_engine, train_step


def main(model_dir: str) -> None:
    import torch.distributed as dist

    from posttrain.rollout_vllm.config import VLLMRolloutConfig

    torch.set_num_threads(1)
    engine = make_engine(model_dir)  # initialises the gloo process group under torchrun
    config = VLLMRolloutConfig(
        dtype=ROLLOUT_DTYPE,
        prompt_length=64,
        response_length=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        update_weights_bucket_megabytes=1,
    )
    rollout = config.build(model_dir, device=engine.device)
    assert rollout.executor == "external_launcher" and rollout.transport_kind == "inprocess", rollout.executor
    train_step(engine, seed=7)
    stream, _ = engine.get_per_tensor_param()
    rollout.update_weights(stream)
    check_greedy(rollout, hf_model(model_dir, engine_weights(engine)[0]), [[1, 2, 3, 4], [9, 8, 7]])
    print(f"RANK {dist.get_rank()} OK", flush=True)
    rollout.release()


if __name__ == "__main__":
    main(sys.argv[1])
