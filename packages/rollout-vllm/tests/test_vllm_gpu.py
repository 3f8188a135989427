"""On a GPU: vLLM colocated with the FSDP engine in one process, its memory budget taken from what the trainer
left free, sleep levels 1 and 2 with the memory they give back measured (and taken into torch's cache while
asleep), and the trained weights served after every wake + sync (greedy tokens and log-probs against the HF
reference, bf16 tolerance derived per check).

Run alone (one vLLM engine with sleep mode per process: vLLM's CuMem allocator allows one instance):
``pytest -m gpu packages/rollout-vllm/tests/test_vllm_gpu.py -s`` prints one JSON line of memory figures.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import needs_vllm
from vllm_testing import ROLLOUT_DTYPE, check_greedy, engine_weights, hf_model, make_engine, train_step

from posttrain.core.config import ModelConfig
from posttrain.core.rollout import SamplingConfig
from posttrain.core.weight_sync import WeightSyncError

pytestmark = [
    needs_vllm,
    pytest.mark.vllm_engine,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7], [100, 3, 250, 9, 9, 41]]
GIB = 2**30


def _sync(rollout, engine, version: int):
    stream, peft = engine.get_per_tensor_param()
    rollout.wake_up(["weights"])
    rollout.update_weights(stream, peft_config=peft, version=version)
    rollout.wake_up(["kv_cache"])
    assert rollout.weight_version() == version
    return hf_model(rollout.model_config.path, engine_weights(engine)[0])


def test_colocated_budget_sleep_levels_and_sync(model_dir):
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    engine = make_engine(model_dir)
    free, total = torch.cuda.mem_get_info()
    config = VLLMRolloutConfig(
        executor="inprocess",
        dtype=ROLLOUT_DTYPE,
        prompt_length=96,
        response_length=32,
        gpu_memory_utilization=0.4,
    )
    rollout = VLLMRollout(config, ModelConfig(path=model_dir))
    try:
        assert rollout.started_with["enforce_eager"] is False, (
            "rollout.enforce_eager=None: CUDA graphs on a GPU"
        )
        share = rollout.started_with["gpu_memory_utilization"]
        assert abs(share - 0.4 * free / total) < 0.02, (share, free / total)
        taken = (free - torch.cuda.mem_get_info()[0]) / GIB
        assert taken <= 0.42 * free / GIB, f"vLLM took {taken:.1f} GiB of a {0.4 * free / GIB:.1f} GiB budget"
        check_greedy(rollout, hf_model(model_dir), PROMPTS)
        figures = {"free_gib_before_vllm": free / GIB, "vllm_took_gib": taken}
        for level, version in ((1, 1), (2, 2)):
            rollout.sleep(level=level)
            figures[f"sleep{level}_freed_gib"] = rollout.memory_stats["sleep_freed_gib"]
            assert rollout.memory_stats["sleep_freed_gib"] > 0.8 * taken, rollout.memory_stats
            if level == 2:
                assert rollout.weight_version() is None, "sleep(level=2) discarded the weights"
                with pytest.raises(WeightSyncError, match="sleep\\(level=2\\)"):
                    rollout.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=4))
            train_step(engine, seed=level)
            # the update's freed activations stay cached in torch's allocator; vLLM maps its pools outside it,
            # so the wake-up must hand the cache back (a Megatron GRPO run on an H100 ran out of memory so).
            # After the step: a tensor that outlives it (optimizer state) inside the cached segment would pin
            # the whole segment, which no empty_cache can return (what this test's first version did)
            cached = torch.empty(torch.cuda.mem_get_info()[0] - GIB, dtype=torch.uint8, device="cuda")
            del cached
            assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > 0.9 * taken * GIB
            check_greedy(rollout, _sync(rollout, engine, version), PROMPTS)
        print("VLLM_GPU_MEMORY " + json.dumps({k: round(v, 3) for k, v in figures.items()}))
    finally:
        rollout.release()


def test_a_budget_larger_than_the_free_memory_is_refused(model_dir):
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    config = VLLMRolloutConfig(dtype=ROLLOUT_DTYPE, gpu_memory_gib=10_000.0)
    with pytest.raises(ValueError, match="gpu_memory_gib=10000.0 asks for more than"):
        VLLMRollout(config, ModelConfig(path=model_dir))
