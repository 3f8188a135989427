"""McoreEngineConfig: its own rules, that it resolves by name without megatron-core, that a Python-built
``PostTrainConfig(model_engine="megatron")`` builds the megatron engine, and the knobs it refuses or
implements."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from posttrain.core.config import CheckpointConfig, EngineConfig, ModelConfig, engine_config_class
from posttrain.megatron.config import McoreEngineConfig


def test_config_imports_without_megatron_core():
    code = (
        "import sys\n"
        "from posttrain.core.config import engine_config_class\n"
        "cls = engine_config_class('megatron')\n"
        "cls(tensor_model_parallel_size=2)\n"
        "print(cls.__module__, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'transformer_engine', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "posttrain.megatron.config []"


def test_registry_hands_out_the_config_that_names_its_engines():
    assert engine_config_class("megatron") is McoreEngineConfig
    assert McoreEngineConfig().engine_class("language_model").__name__ == "MegatronLanguageModelEngine"


def test_megatron_fsdp_checkpoint_rules():
    engine = McoreEngineConfig(use_megatron_fsdp=True)
    with pytest.raises(ValueError, match="optimizer without model.*add model to checkpoint.save_contents"):
        CheckpointConfig(save_contents=["optimizer", "extra"])  # the one rule, for every engine
    with pytest.raises(ValueError, match="set checkpoint.async_save=false"):
        engine.check_checkpoint(CheckpointConfig(async_save=True), "critic")
    McoreEngineConfig().check_checkpoint(CheckpointConfig(async_save=True))  # plain megatron: fine
    with pytest.raises(ValueError, match="set engine.use_distributed_optimizer=true"):
        McoreEngineConfig(use_megatron_fsdp=True, use_distributed_optimizer=False)


def test_parallel_sizes_must_divide_world():
    cfg = McoreEngineConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert cfg.check_world_size(8) == 2
    with pytest.raises(ValueError, match=r"2 x 2 x 1 = 4 does not divide the world size 6"):
        cfg.check_world_size(6)
    cfg = McoreEngineConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4)
    assert cfg.check_world_size(8) == 4
    with pytest.raises(ValueError, match="expert_model_parallel_size x expert_tensor_parallel_size = 4 x 2"):
        cfg.check_world_size(4)


def test_sequence_parallel_and_vanilla_mbridge():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert McoreEngineConfig(tensor_model_parallel_size=2).sequence_parallel is True
    with pytest.warns(FutureWarning, match="deprecated"):
        McoreEngineConfig(vanilla_mbridge=True, sequence_parallel=False)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {"pad_to_length": True, "context_parallel_size": 2},
            "pad_to_length=true with context_parallel_size=2",
        ),
    ],
)
def test_unimplemented_knobs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        McoreEngineConfig(sequence_parallel=False, **kw)


def test_model_engine_in_python_builds_the_megatron_engine(megatron_env, tiny_qwen2, packed_batch):
    """The dataclass API, not the string loader: each role's engine becomes a McoreEngineConfig, and the SFT
    engine config builds (and trains) a megatron engine from it."""
    from megatron_cpu import nll_loss

    from posttrain.megatron.engine import MegatronLanguageModelEngine
    from posttrain.trainers.config import PostTrainConfig
    from posttrain.trainers.roles import ActorConfig

    shared = EngineConfig(dtype="float32", use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    cfg = PostTrainConfig(
        model_engine="megatron", model=ModelConfig(path=tiny_qwen2), actor=ActorConfig(engine=shared)
    )
    for role in ("actor", "ref", "critic"):
        engine_cfg = getattr(cfg, role).engine
        assert type(engine_cfg) is McoreEngineConfig and engine_cfg.strategy == "megatron", role
    assert cfg.actor.engine.dtype == "float32" and cfg.ref.engine.forward_only
    cfg.actor.engine.use_distributed_optimizer = (
        False  # as every CPU engine test here (megatron_cpu.make_engine)
    )
    eng = cfg.actor.engine.build(model=cfg.model, optim=cfg.actor.optim, ckpt=cfg.checkpoint)
    assert isinstance(eng, MegatronLanguageModelEngine)
    before = {k: v.clone() for k, v in eng.get_per_tensor_param()[0]}
    with eng.train_mode():
        out = eng.train_batch(packed_batch, nll_loss)
    after = dict(eng.get_per_tensor_param()[0])
    assert all(torch.isfinite(torch.tensor(out["loss"])))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_per_role_strategy_still_wins():
    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.trainers.config import PostTrainConfig
    from posttrain.trainers.roles import CriticConfig

    cfg = PostTrainConfig(model_engine="megatron", critic=CriticConfig(engine=EngineConfig(strategy="fsdp2")))
    assert type(cfg.actor.engine) is McoreEngineConfig and type(cfg.critic.engine) is FSDP2EngineConfig


def test_replay_mode_names_the_fix():
    from posttrain.trainers.config import load_config
    from posttrain.trainers.rl.router_replay import replay_mode

    megatron = McoreEngineConfig().engine_class("language_model")
    assert megatron.supports_router_replay

    def mode_of(overrides: list[str]) -> str:
        cfg = load_config(overrides)
        return replay_mode(cfg.actor.engine.router_replay.mode, megatron, cfg.rollout.return_routed_experts)

    r3 = ["model_engine=megatron", "actor.engine.router_replay.mode=R3"]
    with pytest.raises(ValueError, match="set rollout.return_routed_experts=true"):
        mode_of(r3)
    assert mode_of([*r3, "rollout.return_routed_experts=true"]) == "R3"
    assert mode_of(["model_engine=megatron", "actor.engine.router_replay.mode=R2"]) == "R2"


def test_tp2_from_the_command_line_keeps_sequence_parallel():
    from posttrain.trainers.config import load_config

    cfg = load_config(
        ["model_engine=megatron", "actor.engine.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]
    )
    assert cfg.actor.engine.sequence_parallel is True
    assert cfg.ref.engine.sequence_parallel is False  # TP=1 there


@pytest.mark.parametrize(
    ("kw", "multiple"),
    [
        ({}, 1),
        ({"tensor_model_parallel_size": 2}, 2),  # sequence parallel splits the stream over TP ranks
        ({"tensor_model_parallel_size": 2, "sequence_parallel": False}, 1),
        ({"override_transformer_config": {"fp8": "hybrid", "fp8_recipe": "tensorwise"}}, 16),
        ({"tensor_model_parallel_size": 2, "override_transformer_config": {"fp8": "e4m3"}}, 32),
        ({"override_transformer_config": {"fp8": "e4m3", "fp8_recipe": "mxfp8"}}, 32),
        ({"override_transformer_config": {"fp8": None}}, 1),
        (
            {
                "pad_to_length": True,
                "pad_to_length_bucket": 24,
                "override_transformer_config": {"fp8": "e4m3"},
            },
            48,
        ),
    ],
)
def test_token_multiple_fits_sequence_parallel_and_fp8(kw, multiple):
    """TE's FP8 GEMMs refuse a stream whose token count is not a multiple of 16 (32 for MXFP8) per rank: the
    1.5B bench's FP8 run failed on a stream of 4,289 tokens before this."""
    assert McoreEngineConfig(**kw).token_multiple == multiple


@pytest.mark.slow
def test_pad_to_length_and_unchunked_head_keep_the_log_probs(megatron_env, tiny_qwen2, packed_batch):
    from megatron_cpu import make_engine

    packed_batch.meta["calculate_entropy"] = True

    def infer(eng, lengths=None):
        if lengths is not None:
            eng.chunks[0].register_forward_pre_hook(
                lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
            )
        with eng.eval_mode():
            return eng.infer_batch(packed_batch)["model_output"]

    ref = infer(make_engine(tiny_qwen2, forward_only=True, entropy_from_logits_chunk_size=3))
    lengths: list[int] = []
    got = infer(
        make_engine(
            tiny_qwen2,
            forward_only=True,
            pad_to_length=True,
            pad_to_length_bucket=16,
            entropy_from_logits_with_chunking=False,
            entropy_from_logits_chunk_size=3,
        ),
        lengths,
    )
    assert lengths and all(n % 16 == 0 for n in lengths), lengths
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key], ref[key], atol=1e-6, rtol=0)
