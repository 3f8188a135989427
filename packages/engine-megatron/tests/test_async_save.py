"""Async save of the megatron engine through the step manager's background writer (one gloo rank, CPU)."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.slow


def _params(eng) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in eng.get_per_tensor_param()[0]}


def test_async_save_snapshots_then_writes_before_the_commit(megatron_env, tiny_qwen2, packed_batch, tmp_path):
    from megatron_cpu import make_engine, nll_loss

    from posttrain.ckpt import CheckpointManager
    from posttrain.core.config import CheckpointConfig

    config = CheckpointConfig(async_save=True)
    manager = CheckpointManager(tmp_path, config)
    eng = make_engine(tiny_qwen2, ckpt=config)
    with eng.train_mode():
        eng.train_batch(packed_batch, nll_loss)
        eng.lr_scheduler_step()
    snapshot = _params(eng)
    staging = manager.stage(1)
    gate = threading.Event()
    manager.writer.submit(gate.wait)  # holds the writer thread: the save below must not wait for it
    eng.save_checkpoint(str(staging / "actor"), global_step=1, writer=manager.writer)
    manager.commit(1)
    ckpt_dir = staging / "actor" / "dist_ckpt"
    assert not (ckpt_dir / "metadata.json").exists()  # returned before writing
    with eng.train_mode():  # training goes on while the save is queued
        eng.train_batch(packed_batch, nll_loss)
        eng.lr_scheduler_step()
    assert manager.latest() is None  # nothing committed yet
    gate.set()
    manager.wait()
    step, path = manager.latest()
    assert step == 1 and (path / "actor" / "dist_ckpt" / "metadata.json").is_file()

    fresh = make_engine(tiny_qwen2)
    fresh.load_checkpoint(str(path / "actor"))
    for name, tensor in _params(fresh).items():  # the snapshot, not the parameters after the later step
        assert torch.equal(tensor, snapshot[name]), name
    assert fresh._lr_step == 1
    manager.close()


def test_async_save_without_writer_names_the_fix(megatron_env, tiny_qwen2, tmp_path):
    from megatron_cpu import make_engine

    from posttrain.core.config import CheckpointConfig

    eng = make_engine(tiny_qwen2, ckpt=CheckpointConfig(async_save=True))
    with pytest.raises(ValueError, match="writer=manager.writer"):
        eng.save_checkpoint(str(tmp_path / "actor"), global_step=1)


def test_second_async_save_waits_for_the_first(megatron_env, tiny_qwen2, tmp_path):
    from megatron_cpu import make_engine

    from posttrain.ckpt import AsyncWriter
    from posttrain.core.config import CheckpointConfig

    writer = AsyncWriter(process_group=torch.distributed.new_group(backend="gloo"))
    eng = make_engine(tiny_qwen2, ckpt=CheckpointConfig(async_save=True))
    eng.save_checkpoint(str(tmp_path / "a"), global_step=1, writer=writer)
    first = eng._pending_save
    eng.save_checkpoint(str(tmp_path / "b"), global_step=2, writer=writer)
    assert first.done() and (tmp_path / "a" / "dist_ckpt" / "metadata.json").is_file()
    writer.close()
    assert (tmp_path / "b" / "dist_ckpt" / "metadata.json").is_file()


def _dcp_tensors(role) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from posttrain.ckpt.hf import dcp_tensor_metadata

    metadata = dcp_tensor_metadata(role / "dist_ckpt")
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(role / "dist_ckpt")), no_dist=True)
    return out


def test_portable_async_save_equals_the_sync_one(megatron_env, tiny_qwen2, packed_batch, tmp_path):
    """engine.portable_checkpoint with async_save: the call returns after the snapshot, the manifest and the
    commit come after the background write, the files equal a sync save bit for bit, and a second save
    waits."""
    from dataclasses import replace

    from megatron_cpu import make_engine, nll_loss
    from safetensors.torch import load_file

    from posttrain.ckpt import CheckpointManager
    from posttrain.core.config import CheckpointConfig

    sync = CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"])
    config = replace(sync, async_save=True)
    manager = CheckpointManager(tmp_path / "async", config)
    eng = make_engine(tiny_qwen2, ckpt=sync, portable_checkpoint=True)
    with eng.train_mode():
        eng.train_batch(packed_batch, nll_loss)
        eng.lr_scheduler_step()
    eng.save_checkpoint(str(tmp_path / "sync" / "actor"), global_step=1)
    eng.checkpoint_config = config
    role = manager.stage(1) / "actor"
    gate = threading.Event()
    manager.writer.submit(gate.wait)  # holds the writer thread: the save below must not wait for it
    eng.save_checkpoint(str(role), global_step=1, writer=manager.writer)
    manager.commit(1)
    assert not (role / "manifest.json").exists() and not (role / "dist_ckpt" / ".metadata").exists()
    with eng.train_mode():  # training goes on while the write is queued
        eng.train_batch(packed_batch, nll_loss)
        eng.lr_scheduler_step()
    assert manager.latest() is None
    gate.set()
    manager.wait()
    step, path = manager.latest()
    assert step == 1 and (path / "actor" / "manifest.json").is_file()

    want, got = _dcp_tensors(tmp_path / "sync" / "actor"), _dcp_tensors(path / "actor")
    assert sorted(got) == sorted(want) and any(k.endswith(".exp_avg_sq") for k in want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    hf_want = load_file(str(tmp_path / "sync" / "actor" / "huggingface" / "model.safetensors"))
    hf_got = load_file(str(path / "actor" / "huggingface" / "model.safetensors"))
    assert sorted(hf_got) == sorted(hf_want) and all(torch.equal(hf_got[k], v) for k, v in hf_want.items())
    loaded = {}
    for name, role_dir in (("sync", tmp_path / "sync" / "actor"), ("async", path / "actor")):
        fresh = make_engine(tiny_qwen2)
        fresh.load_checkpoint(str(role_dir))
        loaded[name] = (_params(fresh), fresh._lr_step)
    assert loaded["async"][1] == loaded["sync"][1] == 1
    assert all(torch.equal(loaded["async"][0][k], v) for k, v in loaded["sync"][0].items())

    eng.save_checkpoint(str(tmp_path / "a" / "actor"), global_step=2, writer=manager.writer)
    first = eng._pending_save
    eng.save_checkpoint(str(tmp_path / "b" / "actor"), global_step=3, writer=manager.writer)
    assert first.done() and (tmp_path / "a" / "actor" / "manifest.json").is_file()
    manager.close()
    assert (tmp_path / "b" / "actor" / "manifest.json").is_file()


def test_direct_async_save_prunes_only_once_it_is_written(megatron_env, tiny_qwen2, tmp_path):
    """A save straight into ``<root>/global_step_<N>/<role>`` with ``max_ckpt_to_keep``: the older checkpoint
    is deleted behind the background write (posttrain.ckpt.retain), never while the new one is being
    written."""
    from dataclasses import replace

    from megatron_cpu import make_engine

    from posttrain.ckpt import CheckpointManager
    from posttrain.core.config import CheckpointConfig

    sync = CheckpointConfig(max_ckpt_to_keep=1)
    eng = make_engine(tiny_qwen2, ckpt=sync)
    root = tmp_path / "run"
    eng.save_checkpoint(str(root / "global_step_1" / "actor"), global_step=1)
    eng.checkpoint_config = replace(sync, async_save=True)
    manager = CheckpointManager(tmp_path / "manager", eng.checkpoint_config)  # only its writer is used
    gate = threading.Event()
    manager.writer.submit(gate.wait)  # holds the writer thread
    eng.save_checkpoint(str(root / "global_step_2" / "actor"), global_step=2, writer=manager.writer)
    assert (root / "global_step_1" / "actor" / "dist_ckpt" / "metadata.json").is_file()  # the last good one
    gate.set()
    manager.wait()
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2"]
    assert (root / "global_step_2" / "actor" / "dist_ckpt" / "metadata.json").is_file()
    manager.close()
