"""Verified checkpoints in one process: damaged files are named (file and tensor), resume falls back to the
newest intact step, NaN/inf is never saved, loaded or exported, and ``posttrain ckpt verify`` reports it
all."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from ckpt_crash_worker import CONTENTS, save, step, tiny_model

from posttrain.ckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    RoleInfo,
    RoleState,
    find_intact,
    find_latest,
    load_role,
    load_trainer_state,
    save_role,
    verify_step,
)
from posttrain.ckpt.cli import main as ckpt_cli
from posttrain.ckpt.hf import export_hf
from posttrain.core.checksum import tensor_checksum
from posttrain.core.config import CheckpointConfig


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    """A root with committed steps 1 and 2 of a small model with AdamW state."""
    model, opt = tiny_model()
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    for s in (1, 2):
        step(model, opt, s)
        save(mgr, model, opt, s)
    return tmp_path


def _flip(path: Path, offset: int, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + n] = bytes(b ^ 0xFF for b in data[offset : offset + n])
    path.write_bytes(bytes(data))


def _tensor_segment(role_dir: Path) -> tuple[str, int, int, str]:
    """(file, offset, length, key) of the largest tensor stored in the role's DCP shards."""
    files = json.loads((role_dir / "manifest.json").read_text())["checksums"]["files"]
    segs = [(n, o, ln, k) for n, rec in files.items() for o, ln, _, k in rec[1] if k and ".distcp" in n]
    return max(segs, key=lambda s: s[2])


def test_manifest_records_row_hash_checksums(two_steps: Path) -> None:
    manifest = json.loads((two_steps / "global_step_2" / "actor" / "manifest.json").read_text())
    fresh, fresh_opt = tiny_model()
    for s in (1, 2):
        step(fresh, fresh_opt, s)
    recorded = manifest["checksums"]["tensors"]
    assert recorded["model.2.weight@0,0"][:3] == ["float32", [4, 32], tensor_checksum(fresh[2].weight)]
    exp_avg = fresh_opt.state[fresh[0].weight]["exp_avg"]
    assert recorded["optimizer.state.0.weight.exp_avg@0,0"][2] == tensor_checksum(exp_avg)
    step_manifest = json.loads((two_steps / "global_step_2" / "checkpoint.json").read_text())
    assert set(step_manifest["checksums"]) == {"data.pt"}
    assert verify_step(two_steps / "global_step_2") == []


def test_flipped_tensor_bytes_named_and_resume_falls_back(two_steps: Path) -> None:
    role = two_steps / "global_step_2" / "actor"
    name, offset, length, key = _tensor_segment(role)
    _flip(role / name, offset + length // 2)
    problems = verify_step(two_steps / "global_step_2")
    assert len(problems) == 1 and name in problems[0] and key.split("@")[0] in problems[0], problems
    assert find_latest(two_steps)[0] == 2  # the unverified scan would take it
    with pytest.warns(UserWarning, match=rf"resuming from .*global_step_1.*skipped global_step_2 .*{name}"):
        assert find_intact(two_steps) == (1, two_steps / "global_step_1")
    model, opt = tiny_model()
    with pytest.raises(CheckpointCorruptError, match=rf"{name}.*tensor {key.split('@')[0]}"):
        load_role(role, RoleState(model=model, optimizer=opt), CONTENTS)
    assert ckpt_cli(["verify", str(two_steps)]) == 1


def test_header_bytes_and_deleted_metadata_named(two_steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    role = two_steps / "global_step_2" / "actor"
    _flip(role / "dist_ckpt" / "__0_0.distcp", 0, 8)
    (two_steps / "global_step_1" / "actor" / "dist_ckpt" / ".metadata").unlink()
    assert ckpt_cli(["verify", str(two_steps)]) == 1
    out = capsys.readouterr().out
    # DCP stores each item as its own torch.save record: the first one's header bytes name that item
    assert "__0_0.distcp: bytes 0-" in out and "(stored value optimizer.param_groups." in out
    assert ".metadata: missing" in out and "newest intact: none" in out
    with pytest.warns(UserWarning, match="no intact checkpoint.*starting fresh"):
        assert find_intact(two_steps) is None


def test_torn_shard_named(two_steps: Path) -> None:
    shard = two_steps / "global_step_2" / "actor" / "dist_ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "torn or truncated" in verify_step(two_steps / "global_step_2")[0]


def test_deleted_manifests_warn(two_steps: Path) -> None:
    (two_steps / "global_step_2" / "checkpoint.json").unlink()
    with pytest.warns(UserWarning, match=r"skipped checkpoint .*global_step_2: incomplete"):
        assert find_latest(two_steps)[0] == 1
    (two_steps / "global_step_1" / "actor" / "manifest.json").unlink()
    with pytest.warns(UserWarning, match=r"global_step_1 \(.*actor/manifest.json: missing"):
        assert find_intact(two_steps) is None


def test_trainer_state_checked(two_steps: Path) -> None:
    data = two_steps / "global_step_2" / "data.pt"
    _flip(data, data.stat().st_size // 2, 4)
    with pytest.raises(CheckpointCorruptError, match=r"data.pt: bytes .* changed"):
        load_trainer_state(two_steps / "global_step_2")
    with pytest.warns(UserWarning, match="skipped global_step_2 .*data.pt"):
        assert find_intact(two_steps)[0] == 1
    (two_steps / "global_step_1" / "data.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"data.pt: missing \(recorded with"):
        load_trainer_state(two_steps / "global_step_1")


def test_non_finite_never_saved_loaded_or_exported(tmp_path: Path) -> None:
    model, opt = tiny_model()
    step(model, opt, 1)
    with torch.no_grad():
        model[2].weight[1, 3] = float("nan")
    state = RoleState(model=model, optimizer=opt)
    with pytest.raises(CheckpointCorruptError, match=r"refusing to save .*first 'model.2.weight'"):
        save_role(tmp_path / "a", state, RoleInfo(), CONTENTS, 1)
    assert not (tmp_path / "a" / "manifest.json").exists()
    save_role(tmp_path / "b", state, RoleInfo(), CONTENTS, 1, verify=False)  # as an unverified save would
    fresh, fresh_opt = tiny_model()
    with pytest.raises(CheckpointCorruptError, match="loaded tensor model.2.weight holds NaN or inf"):
        load_role(tmp_path / "b", RoleState(model=fresh, optimizer=fresh_opt), CONTENTS)
    (tmp_path / "b" / "huggingface" / "config.json").write_text("{}")
    with pytest.raises(CheckpointCorruptError, match="non-finite weights, first '2.weight'"):
        export_hf(tmp_path / "b", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_hf_verifies_first(two_steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    role = two_steps / "global_step_2" / "actor"
    (role / "huggingface" / "config.json").write_text("{}")
    name, offset, length, _ = _tensor_segment(role)
    _flip(role / name, offset + length // 2)
    assert ckpt_cli(["export-hf", str(role), str(two_steps / "out")]) == 1
    assert f"{name}" in capsys.readouterr().err and not (two_steps / "out").exists()


def test_intact_checkpoint_loads_without_warnings(two_steps: Path) -> None:
    model, opt = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_intact(two_steps)[0] == 2
    load_role(two_steps / "global_step_2" / "actor", RoleState(model=model, optimizer=opt), CONTENTS)
    assert ckpt_cli(["verify", str(two_steps / "global_step_2" / "actor")]) == 0


def test_export_hf_names_the_convert_command_for_another_layout(two_steps: Path, tmp_path: Path) -> None:
    """A role whose manifest names a layout keyed by the backend's own names (the Megatron native one) is not
    exported under wrong names: export-hf says which command converts it, before reading or writing
    anything."""
    role = two_steps / "global_step_2" / "actor"
    manifest = json.loads((role / "manifest.json").read_text())
    manifest["layout"] = "megatron-dist-ckpt"
    (role / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"'megatron-dist-ckpt'.*posttrain convert megatron-to-hf --input"):
        export_hf(role, tmp_path / "out")
    assert not (tmp_path / "out").exists()
