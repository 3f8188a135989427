"""Every config rule of the megatron engine raises a ValueError that names the value and the fix."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.core.config import CheckpointConfig, ModelConfig
from posttrain.megatron import rules
from posttrain.megatron.config import McoreEngineConfig

DENSE = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
MOE = {**DENSE, "num_experts": 4}


def _model(tmp_path, hf: dict) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return ModelConfig(path=str(tmp_path))


def _check(tmp_path, hf=DENSE, ckpt=None, on_cuda=True, model_kw=None, **engine_kw):
    model = _model(tmp_path, hf)
    for key, value in (model_kw or {}).items():
        setattr(model, key, value)
    rules.check_engine(McoreEngineConfig(**engine_kw), ckpt or CheckpointConfig(), model, on_cuda=on_cuda)


@pytest.mark.parametrize(
    ("engine_kw", "hf", "match"),
    [
        (
            dict(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2),
            DENSE,
            "virtual_pipeline_model_parallel_size=2 needs",
        ),
        (dict(pipeline_model_parallel_size=3), DENSE, "4 layers"),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4, forward_only=True),
            DENSE,
            "4 layers",
        ),
        (dict(tensor_model_parallel_size=4), DENSE, "num_key_value_heads=2 is not divisible"),
        (dict(expert_model_parallel_size=2), DENSE, "dense model"),
        (dict(expert_model_parallel_size=3), MOE, "4 experts"),
        (dict(router_replay={"mode": "R2"}), DENSE, "router replay needs an MoE model"),
        (
            dict(router_replay={"mode": "R3"}, pipeline_model_parallel_size=2),
            MOE,
            "router_replay.mode=R3 with",
        ),
        (dict(use_dist_checkpointing=True), DENSE, "dist_checkpointing_path"),
        (dict(use_remove_padding=False), DENSE, "use_remove_padding=false"),
        (
            dict(use_megatron_fsdp=True, pipeline_model_parallel_size=2),
            DENSE,
            "use_megatron_fsdp=true with pipeline",
        ),
        (
            dict(context_parallel_size=2, use_megatron_fsdp=True),
            DENSE,
            "context_parallel_size=2 with engine.use_megatron_fsdp=true",
        ),
        (
            dict(context_parallel_size=2, router_replay={"mode": "R2"}),
            MOE,
            "context_parallel_size=2 with engine.router_replay.mode=R2",
        ),
    ],
)
def test_layout_rules(tmp_path, engine_kw, hf, match):
    from posttrain.core.config import RouterReplayConfig

    if "router_replay" in engine_kw:
        engine_kw["router_replay"] = RouterReplayConfig(**engine_kw["router_replay"])
    with pytest.raises(ValueError, match=match):
        _check(tmp_path, hf=hf, **engine_kw)


def test_valid_layouts_pass(tmp_path):
    _check(
        tmp_path,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        forward_only=True,
    )
    _check(tmp_path, hf=MOE, expert_model_parallel_size=4)
    # context parallelism runs in the local attention: no Transformer Engine needed
    _check(tmp_path, context_parallel_size=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)


def test_megatron_fsdp_needs_cuda(tmp_path):
    with pytest.raises(ValueError, match="needs CUDA"):
        _check(tmp_path, on_cuda=False, use_megatron_fsdp=True)


def test_megatron_fsdp_checkpoint_rules(tmp_path):
    with pytest.raises(ValueError, match="async_save=true"):
        _check(tmp_path, ckpt=CheckpointConfig(async_save=True), use_megatron_fsdp=True)


@pytest.mark.parametrize(
    ("model_kw", "engine_kw", "error", "match"),
    [
        ({"lora_adapter_path": "/some/adapter"}, {}, ValueError, "lora_adapter_path='/some/adapter'"),
        ({"target_modules": ["c_attn"]}, {}, ValueError, r"\['c_attn'\]"),
        ({"target_modules": 3}, {}, ValueError, "target_modules=3"),
        (
            {},
            {"portable_checkpoint": True},
            NotImplementedError,
            "portable_checkpoint=true with model.lora_rank=8",
        ),
    ],
)
def test_lora_rules(tmp_path, model_kw, engine_kw, error, match):
    with pytest.raises(error, match=match):
        _check(tmp_path, model_kw={"lora_rank": 8, **model_kw}, **engine_kw)


def test_hf_override_config_is_refused_with_the_megatron_field(tmp_path):
    with pytest.raises(ValueError, match="override_transformer_config"):
        _check(tmp_path, model_kw={"override_config": {"tie_word_embeddings": False}})


def test_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        rules.check_engine(
            McoreEngineConfig(), CheckpointConfig(), ModelConfig(path=str(tmp_path / "nope")), on_cuda=True
        )


def test_vanilla_mbridge_refuses_portable_checkpoints():
    """Refused when the config is built, before any model is loaded (no mbridge needed to see it)."""
    with (
        pytest.warns(FutureWarning, match="deprecated"),
        pytest.raises(ValueError, match="engine.portable_checkpoint=true with engine.vanilla_mbridge=true"),
    ):
        McoreEngineConfig(portable_checkpoint=True, vanilla_mbridge=True)


def test_sequence_parallel_off_at_tp1_warns():
    with pytest.warns(UserWarning, match="no effect"):
        cfg = McoreEngineConfig(tensor_model_parallel_size=1, sequence_parallel=True)
    assert cfg.sequence_parallel is False


def test_override_of_unknown_field_names_it():
    from posttrain.megatron.build import _set_checked

    class Obj:
        known = 1

    with pytest.raises(ValueError, match="override_transformer_config.nope"):
        _set_checked(Obj(), {"nope": 2}, "override_transformer_config")


def test_convert_cli_rejects_bad_sizes():
    from posttrain.megatron.convert_cli import main

    with pytest.raises(ValueError, match="--tp=0"):
        main(["hf-to-megatron", "--hf-model", "x", "--output", "y", "--tp", "0"])


def test_bridge_without_transformer_engine_says_what_to_install():
    """No fixture here: a fresh interpreter without Transformer Engine gets the install hint."""
    import subprocess
    import sys

    code = (
        "from posttrain.megatron._deps import import_bridge\n"
        "try:\n    import_bridge()\nexcept ImportError as e:\n    print('HINT', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600).stdout
    assert "HINT" in out and "transformer_engine" in out and "pip install" in out


def test_hidden_transformer_engine_gives_the_local_spec(tmp_path):
    """bench/megatron_throughput.py's TE-less baseline: with an importable ``transformer_engine`` on the path,
    ``megatron_cpu.hide_transformer_engine`` makes Megatron-Core record TE absent (a fresh interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("__version__ = '9.9'\n")
    code = (
        "import importlib.util, megatron_cpu\n"
        "print('FOUND', importlib.util.find_spec('transformer_engine') is not None)\n"
        "megatron_cpu.hide_transformer_engine(); megatron_cpu.prepare_environment()\n"
        "from posttrain.megatron._deps import has_transformer_engine\n"
        "print('TE', has_transformer_engine())\n"
    )
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert "FOUND True" in proc.stdout and "TE False" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_missing_bridge_names_the_install(monkeypatch):
    """Megatron-Bridge is a prerequisite, not a dependency: without it the first use says how to install
    it."""
    import sys

    from posttrain.megatron._deps import import_bridge

    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # what the import sees when it is not installed
    with pytest.raises(
        ImportError, match=r"Megatron-Bridge >= 0\.6\.2 in place .*posttrain-engine-megatron\[bridge\]"
    ):
        import_bridge()


@pytest.mark.parametrize("version", ["0.6.2", "0.6.3", "0.7.0rc0", "0.7.0.dev0+g1234abc"])
def test_bridge_version_at_the_floor_or_newer_passes(version):
    from posttrain.megatron._deps import check_bridge_version

    check_bridge_version(version)


@pytest.mark.parametrize("version", ["0.6.1", "0.6.2rc1", "0.3.1"])
def test_bridge_older_than_the_floor_is_refused(version):
    from posttrain.megatron._deps import check_bridge_version

    with pytest.raises(
        ImportError, match=rf"Megatron-Bridge {re.escape(version)} is installed; .*>= 0\.6\.2"
    ):
        check_bridge_version(version)


def test_megatron_fsdp_refuses_cuda_device_max_connections_1(tmp_path, monkeypatch):
    """Megatron-FSDP with CUDA_DEVICE_MAX_CONNECTIONS=1 is refused when the engine starts (Megatron-LM and
    Megatron-Bridge assert the same); 8 passes that rule (and meets the CPU's)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1.*unset CUDA_DEVICE_MAX_CONNECTIONS"):
        _check(tmp_path, use_megatron_fsdp=True)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    _check(tmp_path, use_megatron_fsdp=True)
    with pytest.raises(ValueError, match="needs CUDA"):
        _check(tmp_path, on_cuda=False, use_megatron_fsdp=True)
