"""Data-parallel exactness on 2 gloo ranks (one torchrun launch): FSDP2, HSDP, FSDP1 and LoRA steps equal the
same step in one process (grads and params to 1e-6), with unequal micro-batch counts per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fsdp_testing import (
    DIST_LENGTHS,
    case_engine,
    case_loss,
    make_batch,
    reference_cases,
    save_tiny_adapter,
    save_tiny_model,
    train_step,
)

from posttrain.core.testing import torchrun

pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo CPU exactness test; on CUDA see test_gpu.py"),
]


def test_two_rank_layouts_equal_single_process(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "lm")
    save_tiny_model(tmp_path / "value", value_model=True)
    save_tiny_adapter(str(tmp_path / "lm"), tmp_path / "adapter")
    batch = make_batch(DIST_LENGTHS)
    refs = {}
    for name, case in reference_cases(tmp_path).items():
        got = train_step(case_engine(case, strategy=False), batch, case_loss(case))
        refs[name] = {k: got[k] for k in ("grads", "params", "norm")}
    torch.save(refs, tmp_path / "ref.pt")
    torchrun(Path(__file__).with_name("dist_worker.py"), tmp_path, timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    for name, diffs in results.items():
        assert diffs["params"] < 1e-6, (name, diffs)
        if diffs.get("grads") is not None:
            assert diffs["grads"] < 1e-6, (name, diffs)
        if "norm" in diffs:
            assert diffs["norm"] < 1e-6, (name, diffs)
    assert results["fsdp1_orig_params"]["grads"] is not None
