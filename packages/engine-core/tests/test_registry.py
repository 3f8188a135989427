"""Registries: duplicates raise, unknown names list what exists and which package to install."""

import pytest

from posttrain.core.registry import EngineRegistry, RolloutRegistry


def test_duplicate_name_raises():
    reg = EngineRegistry({"language_model.fsdp2.cpu": "a.b:C"})
    reg.register("language_model.fsdp2.cpu", "a.b:C")  # the same target twice is one registration
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("language_model.fsdp2.cpu", "x.y:Z", source="other-dist")


def test_unknown_engine_lists_available_and_install_hint():
    reg = EngineRegistry({"language_model.fsdp2.cpu": "a.b:C"})
    with pytest.raises(
        ValueError, match=r"Installed engines: language_model.fsdp2.cpu.*posttrain-engine-megatron"
    ):
        reg.get_engine_cls("language_model", "megatron", "cpu")


def test_unknown_rollout_names_package():
    with pytest.raises(ValueError, match=r"posttrain-rollout-vllm"):
        RolloutRegistry({}).get_rollout_cls("vllm")


def test_non_engine_target_rejected():
    reg = EngineRegistry({"language_model.x.cpu": "collections:OrderedDict"})
    with pytest.raises(TypeError, match="not a BaseEngine subclass"):
        reg.get_engine_cls("language_model", "x", "cpu")


def test_lazy_import_on_first_use():
    reg = EngineRegistry({"language_model.ghost.cpu": "posttrain_no_such_module:Engine"})
    assert reg.names() == ["language_model.ghost.cpu"]  # building the registry imported nothing
    with pytest.raises(ModuleNotFoundError):
        reg.get_engine_cls("language_model", "ghost", "cpu")
