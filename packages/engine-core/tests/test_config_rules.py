"""Every config rule of the seeds fed its bad combination; the message must name the fix."""

import warnings

import pytest

from posttrain.core.config import (
    CheckpointConfig,
    EngineConfig,
    FSDPEngineConfig,
    McoreEngineConfig,
    OptimizerConfig,
    RouterReplayConfig,
    check_checkpoint_for_engine,
)


def test_megatron_fsdp_optimizer_without_model():
    engine = McoreEngineConfig(use_megatron_fsdp=True)
    # the contents rule fires already in CheckpointConfig (optimizer state is keyed by the model's parameters)
    with pytest.raises(ValueError, match="add model to checkpoint.save_contents"):
        CheckpointConfig(save_contents=["optimizer"])
    ckpt = CheckpointConfig()
    ckpt.save_contents = ["optimizer", "extra"]  # bypass __post_init__ to reach the engine rule
    with pytest.raises(ValueError, match="Megatron-FSDP cannot save or load the optimizer without the model"):
        check_checkpoint_for_engine(engine, ckpt)


def test_megatron_fsdp_async_save():
    with pytest.raises(ValueError, match="set checkpoint.async_save=false"):
        check_checkpoint_for_engine(
            McoreEngineConfig(use_megatron_fsdp=True), CheckpointConfig(async_save=True)
        )
    check_checkpoint_for_engine(
        McoreEngineConfig(), CheckpointConfig(async_save=True)
    )  # plain megatron: fine


def test_megatron_fsdp_needs_distributed_optimizer():
    with pytest.raises(ValueError, match="set engine.use_distributed_optimizer=true"):
        McoreEngineConfig(use_megatron_fsdp=True, use_distributed_optimizer=False)


def test_hf_model_without_model():
    with pytest.raises(ValueError, match="add model to checkpoint.load_contents"):
        CheckpointConfig(load_contents=["hf_model"])
    with pytest.raises(ValueError, match="unknown item"):
        CheckpointConfig(save_contents=["model", "weights"])


def test_parallel_sizes_must_divide_world():
    cfg = McoreEngineConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=False
    )
    assert cfg.check_world_size(8) == 2
    with pytest.raises(ValueError, match=r"2 x 2 x 1 = 4 does not divide the world size 6"):
        cfg.check_world_size(6)


def test_expert_parallel_must_divide_dp_times_tp():
    cfg = McoreEngineConfig(
        tensor_model_parallel_size=2, expert_model_parallel_size=4, sequence_parallel=False
    )
    assert cfg.check_world_size(8) == 4
    with pytest.raises(ValueError, match="expert_model_parallel_size x expert_tensor_parallel_size = 4 x 2"):
        cfg.check_world_size(4)


@pytest.mark.parametrize("dtype", ["int8", "float64", "bf8"])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match="use one of bfloat16, float16, float32"):
        EngineConfig(dtype=dtype)


def test_dtype_aliases():
    assert FSDPEngineConfig(dtype="bf16").dtype == "bfloat16"
    assert FSDPEngineConfig(model_dtype="fp32").model_dtype == "float32"


def test_sequence_parallel_forced_off_at_tp1():
    with pytest.warns(UserWarning, match="turning it off"):
        cfg = McoreEngineConfig(tensor_model_parallel_size=1, sequence_parallel=True)
    assert cfg.sequence_parallel is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert McoreEngineConfig(tensor_model_parallel_size=2).sequence_parallel is True


def test_vanilla_mbridge_deprecated():
    with pytest.warns(FutureWarning, match="deprecated"):
        McoreEngineConfig(vanilla_mbridge=True, sequence_parallel=False)
    assert McoreEngineConfig(sequence_parallel=False).use_mbridge is True


def test_router_replay_modes():
    for mode in ("disabled", "R2", "R3"):
        RouterReplayConfig(mode=mode)
    with pytest.raises(ValueError, match="use disabled, R2 or R3"):
        RouterReplayConfig(mode="R4")


def test_strategy_mismatch():
    with pytest.raises(ValueError, match="use fsdp or fsdp2"):
        FSDPEngineConfig(strategy="megatron")


def test_optimizer_schedule():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine")
    assert cfg.lr_multiplier(0, 10) == pytest.approx(0.5)
    assert cfg.lr_multiplier(1, 10) == pytest.approx(1.0)
    assert cfg.lr_multiplier(2, 10) == pytest.approx(1.0)
    assert cfg.lr_multiplier(10, 10) == pytest.approx(0.1)
    lin = OptimizerConfig(lr=1.0, lr_decay_style="linear", min_lr=0.0)
    assert lin.lr_multiplier(5, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="use one of constant, cosine, linear"):
        OptimizerConfig(lr_decay_style="step")
