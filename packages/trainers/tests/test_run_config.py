"""The run config in Python and from key=value strings: each role's engine becomes its backend's config class,
the rollout its rollout's."""

from __future__ import annotations

import pytest

from posttrain.core.config import EngineConfig
from posttrain.core.config.loader import ConfigError, to_dict
from posttrain.core.rollout import RolloutConfig
from posttrain.fsdp.config import FSDP1EngineConfig, FSDP2EngineConfig
from posttrain.trainers.config import PostTrainConfig, load_config
from posttrain.trainers.roles import ActorConfig

ROLES = ("actor", "ref", "critic")


def test_dataclass_api_resolves_model_engine():
    cfg = PostTrainConfig()
    assert all(type(getattr(cfg, r).engine) is FSDP2EngineConfig for r in ROLES)
    assert [getattr(cfg, r).engine.strategy for r in ROLES] == ["fsdp2"] * 3
    assert cfg.ref.engine.forward_only and not cfg.actor.engine.forward_only
    cfg = PostTrainConfig(model_engine="fsdp", actor=ActorConfig(engine=EngineConfig(dtype="fp32", seed=7)))
    assert all(type(getattr(cfg, r).engine) is FSDP1EngineConfig for r in ROLES)
    assert (cfg.actor.engine.dtype, cfg.actor.engine.seed) == ("float32", 7)  # shared fields carried over


def test_explicit_engine_config_wins_over_model_engine():
    cfg = PostTrainConfig(model_engine="fsdp", actor=ActorConfig(engine=FSDP2EngineConfig(fsdp_size=2)))
    assert cfg.actor.engine.strategy == "fsdp2" and cfg.actor.engine.fsdp_size == 2
    assert type(cfg.critic.engine) is FSDP1EngineConfig


def test_python_and_strings_give_the_same_tree():
    assert to_dict(PostTrainConfig(model_engine="fsdp")) == to_dict(load_config(["model_engine=fsdp"]))


def test_unknown_backend_names_the_key_and_what_to_install():
    with pytest.raises(
        ValueError, match=r"model_engine='fsdp3': 'fsdp3' is not installed \(posttrain.engines: .*fsdp2"
    ):
        PostTrainConfig(model_engine="fsdp3")
    with pytest.raises(ConfigError, match=r"critic.engine.strategy='deepspeed'.*posttrain-engine-megatron"):
        load_config(["critic.engine.strategy=deepspeed"])


def test_world_size_rules_apply_to_fsdp_too():
    with pytest.raises(ConfigError, match="fsdp_size=3 does not divide the world size 4"):
        load_config(["actor.engine.fsdp_size=3", "trainer.n_gpus_per_node=4"])


def test_config_show_exits_2_naming_a_wrong_key(capsys):
    from posttrain.trainers import cli

    assert cli.main(["config", "show", "model_engine=fsdp", "actor.engine.fsdp_sise=2"]) == 2
    assert "actor.engine.fsdp_sise" in capsys.readouterr().err


def test_rollout_config_is_the_named_rollouts_own():
    """``rollout.name`` picks the config class its package registered (posttrain.rollouts): the hf
    rollout's own keys are ``rollout.<key>`` and reach it; a plain RolloutConfig in Python becomes the
    same."""
    from posttrain.rollout_hf.config import HFRolloutConfig

    assert type(PostTrainConfig().rollout) is HFRolloutConfig
    cfg = load_config(["rollout.cache=dynamic", "rollout.stop_check_interval=2", "rollout.n=3"])
    assert type(cfg.rollout) is HFRolloutConfig
    assert (cfg.rollout.cache, cfg.rollout.stop_check_interval, cfg.rollout.n) == ("dynamic", 2, 3)
    python = PostTrainConfig(rollout=RolloutConfig(n=3))
    assert type(python.rollout) is HFRolloutConfig and python.rollout.n == 3
    with pytest.raises(ConfigError, match="rollout.compile=true needs rollout.cache=static"):
        load_config(["rollout.compile=true", "rollout.cache=dynamic"])


def test_rollout_keys_the_named_rollout_does_not_declare_are_refused():
    with pytest.raises(ConfigError, match="unknown config key 'rollout.tempreature'.*temperature"):
        load_config(["rollout.tempreature=0.5"])
    # a rollout that is not installed: the shared keys are accepted (an SFT run needs no rollout), others
    # refused
    assert type(load_config(["rollout.name=sglang", "rollout.n=2"]).rollout) is RolloutConfig
    with pytest.raises(
        ConfigError,
        match=r"rollout.mem_fraction is not a key every rollout shares, and rollout.name='sglang' "
        r"is not installed: install the package that registers rollout 'sglang'",
    ):
        load_config(["rollout.name=sglang", "rollout.mem_fraction=0.5"])
