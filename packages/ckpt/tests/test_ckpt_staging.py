"""Host staging of the synchronous save: exact-size host copies, held until released; host tensors
untouched."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from posttrain.ckpt.staging import HostStaging, StagingSavePlanner, staging_device


def test_staged_copy_equals_source_and_owns_exactly_its_bytes() -> None:
    staging = HostStaging(pin_device=None)
    sources = (
        torch.randn(3, 5),
        torch.randn(4, 6).t(),
        torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
    )
    for src in sources:
        host = staging.stage(src)
        assert host.dtype == src.dtype and host.shape == src.shape and torch.equal(host, src)
        assert host.is_contiguous() and host.untyped_storage().nbytes() == src.numel() * src.element_size()
        assert host.data_ptr() != src.data_ptr()
    assert staging.stage(torch.empty(0, 4)).shape == (0, 4)
    assert staging.staged_bytes == sum(s.numel() * s.element_size() for s in sources)
    staging.release()
    assert staging.staged_bytes == 0


def test_planner_leaves_host_tensors_alone(tmp_path: Path) -> None:
    """On the host nothing is staged; the checkpoint is DCP's usual one."""
    state = {"w": torch.randn(8, 8), "b": torch.randn(8), "step": 3}
    staging = HostStaging(pin_device=None)
    writer = dcp.FileSystemWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer, planner=StagingSavePlanner(staging), no_dist=True)
    out = {"w": torch.zeros(8, 8), "b": torch.zeros(8), "step": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["step"] == 3
    assert staging.staged_bytes == 0
    assert staging_device(state) is None and staging_device({"a": [1, {"b": torch.ones(1)}]}) is None
