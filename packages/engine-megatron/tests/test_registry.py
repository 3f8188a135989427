"""The installed posttrain-engine-megatron distribution registers its config under the name trainers use, and
the config names its engines."""

from posttrain.core.config import engine_config_class
from posttrain.core.engine import BaseEngine


def test_entry_point_resolves_to_the_config_that_builds_the_engines(megatron_env):
    from posttrain.megatron.config import McoreEngineConfig

    assert engine_config_class("megatron") is McoreEngineConfig
    for model_type, name in (
        ("language_model", "MegatronLanguageModelEngine"),
        ("value_model", "MegatronValueModelEngine"),
    ):
        cls = McoreEngineConfig().engine_class(model_type)
        assert cls.__name__ == name and issubclass(cls, BaseEngine)
