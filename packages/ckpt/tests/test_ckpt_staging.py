"""The staging pool of the synchronous save: exact-size host tensors, buffers reused only once released."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from posttrain.ckpt.staging import StagingPool, StagingSavePlanner, staging_device


def test_staged_tensor_equals_source_and_owns_exactly_its_bytes() -> None:
    pool = StagingPool(pin_device=None)
    for src in (torch.randn(3, 5), torch.randn(4, 6).t(), torch.randn(7, dtype=torch.float64).to(torch.bfloat16)):
        host = pool.stage(src)
        assert host.dtype == src.dtype and host.shape == src.shape and torch.equal(host, src)
        assert host.is_contiguous() and host.untyped_storage().nbytes() == src.numel() * src.element_size()
    assert pool.stage(torch.empty(0, 4)).shape == (0, 4)


def test_buffer_is_reused_only_after_the_staged_tensor_dies() -> None:
    pool = StagingPool(pin_device=None)
    a = torch.arange(1000, dtype=torch.float32)
    first = pool.stage(a)
    alias = first.detach()  # DCP's loader keeps a detached alias, not the returned object
    del first
    gc.collect()
    second = pool.stage(a * 2)  # the first buffer is still referenced by ``alias``: a new one
    assert pool.allocations == 2 and pool.held_bytes == 2 * 4000
    assert torch.equal(alias, a) and torch.equal(second, a * 2)
    del alias, second
    gc.collect()
    third = pool.stage(torch.ones(500))  # fits in a released buffer: nothing new
    assert pool.allocations == 2 and torch.equal(third, torch.ones(500))
    del third
    gc.collect()
    pool.stage(torch.ones(2000))  # larger than every buffer: a new one, the too-small free ones dropped
    assert pool.allocations == 3 and pool.held_bytes == 8000 and pool.peak_bytes == 8000


def test_planner_leaves_host_tensors_alone(tmp_path: Path) -> None:
    """On the host nothing is staged; the checkpoint is DCP's usual one."""
    state = {"w": torch.randn(8, 8), "b": torch.randn(8), "step": 3}
    pool = StagingPool(pin_device=None)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), planner=StagingSavePlanner(pool), no_dist=True)
    out = {"w": torch.zeros(8, 8), "b": torch.zeros(8), "step": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 3
    assert pool.allocations == 0
    assert staging_device(state) is None
