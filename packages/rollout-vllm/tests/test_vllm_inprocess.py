"""Real vLLM with its worker in this process: generation, verified weight syncs from the FSDP engine, LoRA,
traps.

One engine serves the whole module (vLLM start-up is the slow part). Every test first syncs the weights it
checks against, so the tests do not depend on each other's order, except the last, which releases the engine.
"""

from __future__ import annotations

import glob
import os

import pytest
from conftest import needs_vllm
from vllm_testing import (
    ROLLOUT_DTYPE,
    check_greedy,
    check_logprobs,
    engine_weights,
    hf_greedy,
    hf_model,
    make_engine,
    random_prompts,
    train_step,
)

from posttrain.core.config import ModelConfig
from posttrain.core.rollout import SamplingConfig, serves_requests
from posttrain.core.weight_sync import BucketSender, WeightSyncError

pytestmark = [needs_vllm, pytest.mark.vllm_engine, pytest.mark.slow]

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7], [100, 3, 250, 9, 9, 41]]


@pytest.fixture(scope="module")
def rollout(model_dir: str):
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    config = VLLMRolloutConfig(
        executor="inprocess",
        dtype=ROLLOUT_DTYPE,
        prompt_length=96,
        response_length=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        update_weights_bucket_megabytes=1,
        engine_kwargs={"block_size": 32},
    )
    r = VLLMRollout(config, ModelConfig(path=model_dir, lora_rank=8))
    yield r
    r.release()


@pytest.fixture(scope="module")
def engine(model_dir: str):
    return make_engine(model_dir)


def sync_engine(rollout, engine):
    """Sync the engine's current weights and return the matching HF reference model."""
    return sync_reporting(rollout, engine)[1]


def sync_reporting(rollout, engine):
    """:func:`sync_engine`, returning the sync's report too."""
    stream, peft = engine.get_per_tensor_param()
    version = (rollout.weight_version() or 0) + 1
    report = rollout.update_weights(stream, peft_config=peft, version=version)
    weights, _ = engine_weights(engine)
    assert report.num_tensors == len(weights) and report.num_buckets >= 2
    assert rollout.weight_version() == version
    return report, hf_model(rollout.model_config.path, weights)


def test_generation_matches_hf_before_any_sync(rollout, model_dir):
    assert rollout.started_with["enforce_eager"] is (rollout.device.type != "cuda"), "enforce_eager=None"
    assert not serves_requests(rollout)  # agenerate needs the server executor: refused before a run starts
    check_greedy(rollout, hf_model(model_dir), PROMPTS)


def test_trained_weights_reach_vllm(rollout, engine):
    before = check_greedy(rollout, sync_engine(rollout, engine), PROMPTS)
    train_step(engine, seed=1)
    after = check_greedy(rollout, sync_engine(rollout, engine), PROMPTS)
    assert before != after, "one training step should change some greedy continuation"


def test_sampled_log_probs_are_those_of_the_tempered_distribution(rollout, engine):
    model = sync_engine(rollout, engine)
    samples = rollout.generate(PROMPTS[:2], SamplingConfig(temperature=0.7, n=3, max_new_tokens=10, seed=5))
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    for s in samples:
        assert len(s.log_probs) == len(s.response_ids) > 0
        check_logprobs(model, s, 0.7)


def test_equal_prompts_of_one_seeded_call_sample_on_their_own(rollout):
    """vLLM seeds each request: one seed for all would give equal prompts equal samples."""
    call = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=11)
    first = [tuple(s.response_ids) for s in rollout.generate([PROMPTS[0]] * 4, call)]
    assert len(set(first)) == 4, first
    again = [tuple(s.response_ids) for s in rollout.generate([PROMPTS[0]] * 4, call)]
    assert again == first, "the same seed should replay the same samples"


def test_lora_adapter_syncs_as_adapter(rollout, model_dir):
    lora_engine = make_engine(model_dir, lora_rank=8, lr=3e-2)
    stream, peft = lora_engine.get_per_tensor_param(base_sync_done=False)
    rollout.update_weights(stream, peft_config=peft, base_sync_done=False)
    base_tokens = check_greedy(rollout, hf_model(model_dir, engine_weights(lora_engine)[0]), PROMPTS)
    for round_ in range(2):
        train_step(lora_engine, seed=10 + round_)
        stream, peft = lora_engine.get_per_tensor_param(base_sync_done=True)
        report = rollout.update_weights(stream, peft_config=peft, base_sync_done=True)
        assert report.num_tensors == 2 * 7 * 2  # lora_A and lora_B of 7 projections in 2 layers
        merged, _ = engine_weights(lora_engine, peft_merge=True)
        tokens = check_greedy(rollout, hf_model(model_dir, merged), PROMPTS)
        assert tokens != base_tokens, "the adapter should change some greedy continuation"


def test_corrupted_bucket_fails_loudly_and_blocks_generation(rollout, engine):
    transport = rollout.transport
    send = transport.send_payload

    def corrupt(bucket):
        if bucket.index == 1:
            meta = bucket.metas[len(bucket.metas) // 2]
            bucket.buffer[meta.offset + 3] ^= 0x10
        send(bucket)

    transport.send_payload = corrupt
    try:
        with pytest.raises(WeightSyncError, match="checksum mismatch"):
            rollout.update_weights(engine.get_per_tensor_param()[0])
    finally:
        transport.send_payload = send
    with pytest.raises(WeightSyncError, match="no valid weights"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=4))
    assert rollout.weight_version() is None, "a failed sync must not leave a version the trainer would accept"
    assert rollout.engine.collective_rpc("ws_version") == [None]
    check_greedy(rollout, sync_engine(rollout, engine), PROMPTS)


def test_partial_stream_is_an_error(rollout, engine):
    weights, _ = engine_weights(engine)
    partial = [(n, t) for n, t in weights.items() if n != "model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightSyncError, match="without new values"):
        rollout.update_weights(partial)
    with pytest.raises(WeightSyncError, match="no valid weights"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=4))
    check_greedy(rollout, sync_engine(rollout, engine), PROMPTS)


def test_prefix_cache_is_reset_after_every_sync(rollout, engine, model_dir):
    """Prompts of 66-72 tokens fill two 32-token blocks that vLLM caches. Loading new weights without a cache
    reset serves those blocks' old keys and values (the control below shows the trap is real here)."""
    prompts = random_prompts(3, 66, seed=3)
    old = sync_engine(rollout, engine)
    check_greedy(rollout, old, prompts, max_new_tokens=8)
    train_step(engine, seed=2)
    weights, _ = engine_weights(engine)
    new = hf_model(model_dir, weights)
    # Control: load through the worker extension directly, skipping the reset.
    transport = rollout.transport
    rollout.engine.collective_rpc("ws_begin", "base", None, None)
    BucketSender(transport, transport.buffer.numel(), buffer=transport.buffer).send(weights.items())
    rollout.engine.collective_rpc("ws_finish")
    stale = rollout.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=8))
    expected = [hf_greedy(new, p, 8)[0] for p in prompts]
    assert [s.response_ids for s in stale] != expected, (
        "without a reset vLLM should serve stale cached blocks"
    )
    assert rollout.engine.reset_prefix_cache()
    check_greedy(rollout, new, prompts, max_new_tokens=8)
    # The real path resets by itself: the cache now holds blocks of the current weights.
    train_step(engine, seed=4)
    check_greedy(rollout, sync_engine(rollout, engine), prompts, max_new_tokens=8)


def test_a_sync_resets_the_prefix_cache_only_after_requests_filled_it(rollout, engine):
    """vLLM's reset walks every KV block, so a sync resets the prefix cache only when a request ran since the
    last reset; vLLM's sleep resets it too (on a GPU; on a CPU there is no sleep mode). The trap's prompts,
    generated before each update and again after, give the new weights' tokens whether the sync reset or
    skipped."""
    prompts = random_prompts(3, 66, seed=5)
    check_greedy(rollout, sync_engine(rollout, engine), prompts, max_new_tokens=8)
    assert rollout.prefix_cache_filled, "the prompts' blocks are cached"
    train_step(engine, seed=6)
    report, _ = sync_reporting(rollout, engine)
    assert "prefix_reset_s" in report.timings and not rollout.prefix_cache_filled
    train_step(engine, seed=7)
    report, model = sync_reporting(rollout, engine)
    assert "prefix_reset_s" not in report.timings, "no request ran since the last reset"
    check_greedy(rollout, model, prompts, max_new_tokens=8)
    rollout.sleep(level=2)  # as the trainer does between generating and syncing
    train_step(engine, seed=8)
    report, model = sync_reporting(rollout, engine)
    assert ("prefix_reset_s" in report.timings) is not rollout.sleep_enabled, "vLLM's sleep resets the cache"
    check_greedy(rollout, model, prompts, max_new_tokens=8)


def test_sleep_and_wake_levels(rollout, engine):
    model = sync_engine(rollout, engine)
    rollout.sleep(level=1)
    rollout.wake_up(["weights"])
    rollout.wake_up(["kv_cache"])
    check_greedy(rollout, model, PROMPTS)
    rollout.sleep(level=2)
    with pytest.raises(WeightSyncError, match="sleep\\(level=2\\)"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=4))
    check_greedy(rollout, sync_engine(rollout, engine), PROMPTS)
    with pytest.raises(ValueError, match="sleep level 3"):
        rollout.sleep(level=3)
    with pytest.raises(ValueError, match="unknown"):
        rollout.wake_up(["optimizer"])


def test_release_removes_the_adapter_directories(rollout, model_dir):
    """Last in the module: it releases the module's engine (the fixture's own release then does nothing)."""
    before = set(glob.glob("/dev/shm/posttrain-lora-*"))
    lora_engine = make_engine(model_dir, lora_rank=8)
    for base_sync_done in (False, True):
        stream, peft = lora_engine.get_per_tensor_param(base_sync_done=base_sync_done)
        rollout.update_weights(stream, peft_config=peft, base_sync_done=base_sync_done)
    written = set(glob.glob("/dev/shm/posttrain-lora-*")) - before
    if not written:  # a machine without a writable /dev/shm: the adapter went to the temp dir
        written = {rollout._lora_request.lora_path.rsplit("/", 1)[0]}
    rollout.release()
    assert not [d for d in written if os.path.exists(d)], f"left behind: {written}"
