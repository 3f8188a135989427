"""The installed posttrain-engine-megatron distribution registers its engines and config under the names
trainers use."""

from posttrain.core import BaseEngine, EngineRegistry


def test_entry_points_resolve_to_the_engines(megatron_env):
    from posttrain.megatron.config import McoreEngineConfig

    registry = EngineRegistry.from_entry_points()
    for model_type, name in (
        ("language_model", "MegatronLanguageModelEngine"),
        ("value_model", "MegatronValueModelEngine"),
    ):
        cls = registry.get_engine_cls(model_type, "megatron")
        assert cls.__name__ == name and issubclass(cls, BaseEngine)
    assert registry.get_config_cls("megatron") is McoreEngineConfig
