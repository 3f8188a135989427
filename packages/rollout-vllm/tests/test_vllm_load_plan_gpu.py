"""On a GPU: the recorded load plan (:mod:`posttrain.rollout_vllm.load_plan`) writes into a real vLLM exactly
what ``load_weights`` writes, and the trained weights it syncs are the ones served (greedy tokens against HF).

Run alone (one sleep-mode vLLM engine per process):
``pytest packages/rollout-vllm/tests/test_vllm_load_plan_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_vllm
from vllm_testing import ROLLOUT_DTYPE, check_greedy, engine_weights, hf_model, make_engine, train_step

from posttrain.core.checksum import tensor_checksums
from posttrain.core.config import ModelConfig

pytestmark = [
    needs_vllm,
    pytest.mark.vllm_engine,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7]]


def _digest(worker) -> dict[str, int]:
    params = dict(worker.model_runner.get_model().named_parameters())
    return dict(zip(params, tensor_checksums(list(params.values()))))


def _sync(rollout, engine, version: int) -> dict[str, int]:
    stream, peft = engine.get_per_tensor_param()
    report = rollout.update_weights(stream, peft_config=peft, version=version)
    assert report.num_tensors > 0 and rollout.weight_version() == version
    return rollout.engine.collective_rpc(_digest)[0]


def test_the_replayed_plan_writes_what_load_weights_writes(model_dir, monkeypatch):
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    engine = make_engine(model_dir)
    config = VLLMRolloutConfig(
        executor="inprocess",
        dtype=ROLLOUT_DTYPE,
        prompt_length=96,
        response_length=32,
        gpu_memory_utilization=0.3,
    )
    rollout = VLLMRollout(config, ModelConfig(path=model_dir))
    try:
        before = _sync(rollout, engine, 1)  # records the plan
        plan = rollout.engine.collective_rpc("ws_plan_report")[0]
        print("LOAD_PLAN", plan)
        assert plan["planned"] > 0 and plan["last_sync"].startswith("recorded"), plan
        train_step(engine, seed=3)
        replayed = _sync(rollout, engine, 2)
        assert rollout.engine.collective_rpc("ws_plan_report")[0]["last_sync"] == "replayed"
        assert replayed != before, "the trained weights changed nothing in vLLM"
        check_greedy(rollout, hf_model(model_dir, engine_weights(engine)[0]), PROMPTS)
        monkeypatch.setenv("POSTTRAIN_VLLM_LOAD_PLAN", "0")
        assert _sync(rollout, engine, 3) == replayed, "the plan and load_weights wrote different values"
    finally:
        rollout.release()
