"""Real vLLM with its engine in other processes: weights cross through POSIX shared memory (CPU) or a CUDA IPC
buffer (GPU), verified the same way.

``multiprocess`` drives an offline ``LLM`` whose engine core and worker are child processes; ``server`` is the
``AsyncLLM`` front used for async rollout. Tensors cannot travel as ``collective_rpc`` arguments there, so
these tests cover the shared-buffer path end to end, including a bucket corrupted in the shared buffer.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from conftest import needs_vllm
from vllm_testing import (
    ON_GPU,
    ROLLOUT_DTYPE,
    check_greedy,
    check_logprobs,
    engine_weights,
    hf_model,
    make_engine,
    train_step,
)

from posttrain.core.rollout import SamplingConfig, serves_requests
from posttrain.core.weight_sync import WeightSyncError

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [5, 6, 7, 8, 9]]


def build(model_dir: str, executor: str, deterministic: bool = False):
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    config = VLLMRolloutConfig(
        executor=executor,
        dtype=ROLLOUT_DTYPE,
        prompt_length=64,
        response_length=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        update_weights_bucket_megabytes=1,
        engine_kwargs={"block_size": 32},
    )
    return VLLMRollout(config, model_dir, deterministic=deterministic)


def sync_and_check(rollout, engine, model_dir):
    stream, _ = engine.get_per_tensor_param()
    report = rollout.update_weights(stream)
    assert report.num_buckets >= 2
    model = hf_model(model_dir, engine_weights(engine)[0])
    check_greedy(rollout, model, PROMPTS)
    return model


def test_deterministic_rollout_runs_vllm_batch_invariant_on_a_gpu(model_dir, monkeypatch):
    """``deterministic=True`` (the trainer's ``actor.engine.full_determinism``): on a GPU vLLM's worker, a
    child process started after, reads ``VLLM_BATCH_INVARIANT`` as on; on a CPU the rollout warns and leaves
    it off (with it on, vLLM's CPU worker fails at its first mean: Triton kernels). Either way the engine
    generates HF's greedy tokens."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # recorded: unset again after the test
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # lets collective_rpc carry the probe below
    if ON_GPU:
        rollout = build(model_dir, "multiprocess", deterministic=True)
    else:
        with pytest.warns(UserWarning, match="batch-invariant mode needs a GPU"):
            rollout = build(model_dir, "multiprocess", deterministic=True)
    try:
        seen = rollout.engine.collective_rpc(
            lambda worker: (os.getpid(), __import__("vllm.envs").envs.VLLM_BATCH_INVARIANT)
        )
        assert [flag for _, flag in seen] == [ON_GPU] and seen[0][0] != os.getpid(), seen
        assert rollout.batch_invariant is ON_GPU
        check_greedy(rollout, hf_model(model_dir), PROMPTS)
    finally:
        rollout.release()


def test_multiprocess_executor_syncs_through_shared_memory_or_cuda_ipc(model_dir):
    rollout = build(model_dir, "multiprocess")
    try:
        assert rollout.transport_kind == ("cuda_ipc" if ON_GPU else "shm")
        engine = make_engine(model_dir)
        train_step(engine, seed=1)
        sync_and_check(rollout, engine, model_dir)
        transport = rollout.transport
        send = transport.send_payload

        def corrupt(payload: bytes) -> None:
            transport.buffer[300] ^= 0x01  # inside the first tensor of every bucket
            send(payload)

        transport.send_payload = corrupt
        try:
            with pytest.raises(WeightSyncError, match="checksum mismatch"):
                rollout.update_weights(engine.get_per_tensor_param()[0])
        finally:
            transport.send_payload = send
        with pytest.raises(WeightSyncError, match="no valid weights"):
            rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=4))
        train_step(engine, seed=2)
        sync_and_check(rollout, engine, model_dir)
        with pytest.raises(ValueError, match="lora_rank > 0"):
            rollout.update_weights([], peft_config={"r": 8}, base_sync_done=True)
    finally:
        rollout.release()


def test_server_executor_serves_async_requests_and_syncs(model_dir):
    rollout = build(model_dir, "server")
    try:
        assert serves_requests(rollout)  # what the async agent loop and stream mode check before they start
        engine = make_engine(model_dir)
        train_step(engine, seed=3)
        model = sync_and_check(rollout, engine, model_dir)
        sampling = SamplingConfig(temperature=0.9, n=2, max_new_tokens=8, seed=11)

        async def many():
            return await asyncio.gather(
                *(rollout.agenerate(p, sampling, prompt_index=i) for i, p in enumerate(PROMPTS))
            )

        groups = asyncio.run(many())
        for i, group in enumerate(groups):
            assert len(group) == 2 and all(s.prompt_index == i for s in group)
            for s in group:
                check_logprobs(model, s, 0.9)
    finally:
        rollout.release()
