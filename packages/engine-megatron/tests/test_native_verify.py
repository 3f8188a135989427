"""The native Megatron checkpoint (portable_checkpoint=false) is verified like the portable one: checksums at
save, every file checked before a load, the loaded tensors checked after, resume falls back past a damaged
step naming the file and tensor, ``posttrain ckpt verify`` reads it, NaN is never saved, bad hf_save_kwargs
are refused."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

pytestmark = pytest.mark.slow

CONTENTS = ["model", "optimizer", "extra"]


@pytest.fixture(scope="module")
def saved(megatron_env, tiny_qwen2, tmp_path_factory):
    """(engine, root): steps 1 and 2 committed through the step manager, with trainer state."""
    from megatron_cpu import make_engine, nll_loss, sample_batch

    from posttrain.ckpt import CheckpointManager
    from posttrain.core.config import CheckpointConfig

    config = CheckpointConfig(save_contents=CONTENTS, load_contents=CONTENTS)
    root = tmp_path_factory.mktemp("native")
    manager = CheckpointManager(root, config)
    eng = make_engine(tiny_qwen2, ckpt=config)
    for step in (1, 2):
        with eng.train_mode():
            eng.train_batch(sample_batch(), nll_loss)
            eng.lr_scheduler_step()
        staging = manager.stage(step)
        eng.save_checkpoint(str(staging / "actor"), global_step=step)
        manager.save_trainer_state(step, {"global_step": step})
        manager.commit(step)
    manager.close()
    return eng, root


@pytest.fixture
def root(saved, tmp_path):
    """A copy of the saved root that a test may damage."""
    shutil.copytree(saved[1], tmp_path / "run")
    return tmp_path / "run"


def _flip(path, offset: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + n] = bytes(b ^ 0xFF for b in data[offset : offset + n])
    path.write_bytes(bytes(data))


def _largest_tensor(role):
    files = json.loads((role / "manifest.json").read_text())["checksums"]["files"]
    segs = [(n, o, ln, k) for n, rec in files.items() for o, ln, _, k in rec[1] if k and ".distcp" in n]
    return max(segs, key=lambda s: s[2])


def test_native_save_records_checksums_and_verifies(saved):
    from posttrain.ckpt import verify_step
    from posttrain.ckpt.cli import main as ckpt_cli
    from posttrain.core.checksum import tensor_checksum
    from posttrain.megatron import build

    eng, root = saved
    step = json.loads((root / "global_step_2" / "checkpoint.json").read_text())
    assert step["roles"] == ["actor"]  # listed, so verify_step and resume cover it
    manifest = json.loads((root / "global_step_2" / "actor" / "manifest.json").read_text())
    assert manifest["layout"] == "megatron-dist-ckpt" and manifest["global_step"] == 2
    tensors, files = manifest["checksums"]["tensors"], manifest["checksums"]["files"]
    weight = build.unwrap(eng.chunks[0]).state_dict()["decoder.layers.0.mlp.linear_fc1.weight"]
    assert tensors["model0.decoder.layers.0.mlp.linear_fc1.weight@0"][2] == tensor_checksum(weight)
    assert any(k.endswith(".exp_avg_sq@0") for k in tensors)
    assert {"dist_ckpt/.metadata", "dist_ckpt/metadata.json", "transformer_config.json"} <= set(files), (
        sorted(files)
    )
    assert verify_step(root / "global_step_2") == []
    assert ckpt_cli(["verify", str(root)]) == 0


def test_flipped_shard_byte_named_and_resume_falls_back(saved, root, capsys):
    from posttrain.ckpt import CheckpointCorruptError, find_intact
    from posttrain.ckpt.cli import main as ckpt_cli

    role = root / "global_step_2" / "actor"
    name, offset, length, key = _largest_tensor(role)
    _flip(role / name, offset + length // 2)
    tensor = key.split("@")[0]
    with pytest.warns(UserWarning, match=rf"resuming from .*global_step_1.*skipped global_step_2 .*{name}"):
        assert find_intact(root) == (1, root / "global_step_1")
    with pytest.raises(CheckpointCorruptError, match=rf"{name}.*tensor {tensor}"):
        saved[0].load_checkpoint(str(role))
    assert ckpt_cli(["verify", str(root)]) == 1
    assert "newest intact: " + str(root / "global_step_1") in capsys.readouterr().out


def test_flipped_trainer_state_and_deleted_manifest_caught(saved, root):
    from posttrain.ckpt import CheckpointCorruptError, find_intact, load_trainer_state

    data = root / "global_step_2" / "data.pt"
    _flip(data, data.stat().st_size // 2, 4)
    with pytest.raises(CheckpointCorruptError, match=r"data.pt: bytes .* changed"):
        load_trainer_state(root / "global_step_2")
    with pytest.warns(UserWarning, match="skipped global_step_2 .*data.pt"):
        assert find_intact(root)[0] == 1
    (root / "global_step_1" / "actor" / "manifest.json").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"actor/manifest.json: missing"):
        saved[0].load_checkpoint(str(root / "global_step_1" / "actor"))


def test_loaded_tensors_checked_against_their_checksums(saved, root):
    """A load whose tensors differ from what the save recorded (here: the record edited) is refused by name;
    the intact one loads and returns the saved counters."""
    from posttrain.ckpt import CheckpointCorruptError

    eng = saved[0]
    role = root / "global_step_1" / "actor"
    assert eng.load_checkpoint(str(role)) == {"global_step": 1, "skipped_steps": 0}
    manifest = json.loads((role / "manifest.json").read_text())
    key = "model0.decoder.final_layernorm.weight@0"
    manifest["checksums"]["tensors"][key][2] ^= 1
    (role / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointCorruptError, match="decoder.final_layernorm.weight does not match its saved"
    ):
        eng.load_checkpoint(str(role))


def test_non_finite_state_is_never_saved(saved, tmp_path):
    from posttrain.ckpt import CheckpointCorruptError
    from posttrain.megatron import build

    eng = saved[0]
    weight = build.unwrap(eng.chunks[0]).decoder.final_layernorm.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0] = float("nan")
    try:
        with pytest.raises(CheckpointCorruptError, match=r"refusing to save .*final_layernorm.weight"):
            eng.save_checkpoint(str(tmp_path / "global_step_3" / "actor"), global_step=3)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert not (tmp_path / "global_step_3" / "actor" / "dist_ckpt" / ".metadata").exists()


def test_unknown_hf_save_kwargs_refused_at_engine_start(megatron_env, tiny_qwen2):
    from megatron_cpu import make_engine

    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match=r"\['not_a_bridge_kwarg'\].*distributed_save"),
    ):
        make_engine(tiny_qwen2, hf_save_kwargs={"distributed_save": False, "not_a_bridge_kwarg": 1})
    with pytest.raises(
        ValueError, match=r"engine.hf_save_kwargs.weight_dtype='bf17' is not a supported dtype"
    ):
        make_engine(tiny_qwen2, hf_save_kwargs={"weight_dtype": "bf17"})


def test_hf_save_kwargs_weight_dtype_name_becomes_a_dtype():
    from posttrain.megatron.checkpoint import hf_save_kwargs
    from posttrain.megatron.config import McoreEngineConfig

    cfg = McoreEngineConfig(hf_save_kwargs={"weight_dtype": "bfloat16", "distributed_save": True})
    assert hf_save_kwargs(cfg) == {"weight_dtype": torch.bfloat16, "distributed_save": True}
