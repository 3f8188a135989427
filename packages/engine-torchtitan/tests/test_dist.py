"""Two gloo ranks (one torchrun launch) equal one process: an FSDP2 step, each rank on part of the batch (unequal
micro-batch counts), gives the single-process step's weights and grad norm; the 2-rank checkpoint resumes in one process
on the FSDP engine (N -> M ranks, across backends)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_worker import LENGTHS
from titan_testing import make_batch, make_engine, pg_loss, save_tiny_model

from posttrain.core.testing import torchrun

pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo CPU exactness test"),
]


def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model")
    ref = make_engine(str(tmp_path / "model"), max_token_len_per_gpu=16)
    with ref.train_mode():
        norm = ref.train_batch(make_batch(LENGTHS), pg_loss)["metrics"]["grad_norm"]
    want = dict(ref.get_per_tensor_param()[0])
    torchrun(Path(__file__).with_name("dist_worker.py"), tmp_path, timeout=600)
    for case in ("fsdp2",):
        got = torch.load(tmp_path / f"{case}.pt")
        assert got["norm"] == pytest.approx(norm, rel=1e-5)
        assert set(got["params"]) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"{case} {name}")

    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    fsdp = FSDPLanguageModelEngine(
        ModelConfig(path=str(tmp_path / "model")),
        FSDP2EngineConfig(dtype="fp32"),
        OptimizerConfig(lr=1e-3),
        CheckpointConfig(),
    )
    fsdp.initialize()
    fsdp.load_checkpoint(str(tmp_path / "ckpt" / "global_step_1" / "actor"))
    loaded = dict(fsdp.get_per_tensor_param()[0])
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert fsdp.optimizer.state  # the AdamW moments came back too
