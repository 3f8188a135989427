"""FSDP engine checkpoints across layouts (one torchrun launch): saved by an FSDP2 engine on 2 gloo ranks,
loaded on 2 ranks by FSDP2 and FSDP1 engines and in one process by a plain engine, state identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_testing import save_tiny_model

from posttrain.core.config import CheckpointConfig
from posttrain.core.testing import torchrun
from posttrain.fsdp.checkpoint import load_fsdp_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_fsdp2_checkpoint_loads_on_2_ranks_and_on_1(tmp_path: Path) -> None:
    from checkpoint_dist_worker import engine, full_state

    save_tiny_model(tmp_path / "lm")
    torchrun(Path(__file__).with_name("checkpoint_dist_worker.py"), tmp_path, timeout=600)
    assert (tmp_path / "ok_rank0").is_file() and (tmp_path / "ok_rank1").is_file()

    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    single = engine(str(tmp_path / "lm"), "fsdp2")  # no process group here: a plain module
    assert type(single.layout).__name__ == "PlainLayout"
    single.checkpoint_config = CheckpointConfig(load_contents=["model", "optimizer", "extra"])
    counters = load_fsdp_checkpoint(single, str(tmp_path / "ckpt" / "global_step_1" / "actor"))
    assert counters == {"global_step": 1, "skipped_steps": 0}
    got = full_state(single)
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
