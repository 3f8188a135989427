"""CUDA paths: async save snapshots device tensors into pinned host buffers prepared in the background; load
back onto the device."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from posttrain.ckpt import CheckpointManager, RoleInfo, RoleState, load_role, prepare_role, save_role
from posttrain.core.config import CheckpointConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CONTENTS = ["model", "optimizer", "extra"]


def _cuda_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(64, 256, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_async_save_of_cuda_state(tmp_path: Path) -> None:
    model, opt = _cuda_model()
    _step(model, opt)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(async_save=True))
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    prepared = prepare_role("actor", RoleState(model=model, optimizer=opt), CONTENTS, mgr.writer)
    for step in (1, 2):  # both saves reuse the pinned buffers prepared in the background
        staging = mgr.stage(step)
        save_role(
            staging / "actor", RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, step, mgr.writer
        )
        mgr.commit(step)
        bufs = prepared.result()
        assert all(mgr.writer.host_buffers[k] is v for k, v in bufs.items())
        assert any("step" not in k.rsplit(".", 1)[-1] for k in bufs)  # CUDA tensors among the buffers
    for _ in range(3):  # training goes on while step 2 is written
        _step(model, opt)
    mgr.close()
    fresh, fresh_opt = _cuda_model()
    load_role(tmp_path / "global_step_2" / "actor", RoleState(model=fresh, optimizer=fresh_opt), CONTENTS)
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v, saved[k]), k
    for p, want in zip(fresh.parameters(), saved_avg):
        assert torch.equal(fresh_opt.state[p]["exp_avg"], want)


def test_registered_host_buffer_copies_like_pinned_memory() -> None:
    """host_empty's page-locked buffer takes device-to-host copies at pinned speed (pageable: ~3x slower)."""
    from posttrain.ckpt.pinned import host_empty

    src = torch.randn(64 * 2**20, device="cuda")  # 256 MiB
    registered = host_empty(src.shape, src.dtype, pin_device=torch.cuda.current_device())
    pageable = torch.empty(src.shape, dtype=src.dtype).zero_()

    def copy_time(dst: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    fast, slow = copy_time(registered), copy_time(pageable)
    assert torch.equal(registered, src.cpu())
    assert fast < 0.6 * slow, (fast, slow)


def test_sync_save_writes_cuda_state_from_page_locked_copies(tmp_path: Path) -> None:
    """A sync save of CUDA tensors stages every tensor into a page-locked host copy, and loads back equal."""
    import torch.distributed.checkpoint as dcp

    from posttrain.ckpt.staging import HostStaging, StagingSavePlanner, staging_device

    state = {f"t{i}": torch.randn(2**20 + i, device="cuda") for i in range(32)}  # 32 x ~4 MiB
    device = staging_device({"nested": [state]})
    assert device == torch.cuda.current_device()
    seen: list[bool] = []

    class Recording(HostStaging):  # the real staging; records whether each copy is page-locked
        def stage(self, src: torch.Tensor) -> torch.Tensor:
            host = super().stage(src)
            seen.append(host.is_pinned())
            return host

    staging = Recording(device)
    writer = dcp.FileSystemWriter(str(tmp_path / "dcp"), thread_count=4)
    dcp.save(state, storage_writer=writer, planner=StagingSavePlanner(staging), no_dist=True)
    assert staging.staged_bytes == sum(t.numel() * 4 for t in state.values())
    assert len(seen) == 32 and all(seen)  # every tensor went through a registered (page-locked) copy
    staging.release()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in state.items())

    model, opt = _cuda_model()  # and through save_role (sync), model + optimizer
    _step(model, opt)
    save_role(tmp_path / "actor", RoleState(model=model, optimizer=opt), RoleInfo(), CONTENTS, 1)
    fresh, fresh_opt = _cuda_model()
    load_role(tmp_path / "actor", RoleState(model=fresh, optimizer=fresh_opt), CONTENTS)
    for (k, v), w in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(v, w), k
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(fresh_opt.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
