"""OmegaConf merge of dataclass schemas: presets, overrides, one-line errors."""

from dataclasses import dataclass, field

import pytest

from posttrain.core.config import CheckpointConfig, EngineConfig
from posttrain.core.config.loader import ConfigError, merge_config, to_yaml


@dataclass(kw_only=True)
class ShardedEngineConfig(EngineConfig):
    """A backend's config as a third-party engine would declare it."""

    strategy: str | None = "sharded"
    fsdp_size: int = -1


@dataclass(kw_only=True)
class Root:
    engine: EngineConfig = field(default_factory=ShardedEngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def test_overrides_and_presets(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("engine:\n  fsdp_size: 2\n  dtype: float32\n")
    cfg = merge_config(Root(), [preset], ["engine.fsdp_size=4", "checkpoint.save_contents=[model,hf_model]"])
    assert isinstance(cfg.engine, ShardedEngineConfig)
    assert (cfg.engine.fsdp_size, cfg.engine.dtype) == (4, "float32")
    assert cfg.checkpoint.save_contents == ["model", "hf_model"]
    assert "fsdp_size: 4" in to_yaml(cfg)


def test_unknown_key_lists_allowed():
    with pytest.raises(ConfigError, match=r"unknown config key 'engine.fsdp_sise'.*fsdp_size"):
        merge_config(Root(), [], ["engine.fsdp_sise=2"])


def test_bad_type_and_post_init_errors():
    with pytest.raises(ConfigError, match="bad value for 'engine.fsdp_size'"):
        merge_config(Root(), [], ["engine.fsdp_size=two"])
    with pytest.raises(ValueError, match="add model to checkpoint.save_contents"):
        merge_config(Root(), [], ["checkpoint.save_contents=[hf_model]"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        merge_config(Root(), [], ["engine.fsdp_size"])
