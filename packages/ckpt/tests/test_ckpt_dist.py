"""Save on 2 gloo ranks (FSDP2, tied embeddings), resume on 2 ranks in new processes (bitwise), load on 1
process.

Two torchrun launches in all (see ckpt_dist_worker.py); the 1-process checks run in the pytest process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_testlib import K_STEPS, assert_identical, build, full_state, rng_equal

from posttrain.ckpt import RoleState, capture_rng, find_latest, load_full_model_state, load_role
from posttrain.ckpt.cli import main as ckpt_cli
from posttrain.core.testing import torchrun

WORKER = Path(__file__).parent / "ckpt_dist_worker.py"
pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _torchrun(phase: str, out: Path) -> None:
    torchrun(WORKER, phase, out, timeout=600)
    assert all((out / f"{phase}_ok_rank{r}").is_file() for r in range(2))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _torchrun("save", out)
    _torchrun("resume", out)
    return out


def test_save_2_resume_2_bitwise(run_dir: Path) -> None:
    """The resume phase asserted state, RNG, losses and final params bit for bit on both ranks."""
    assert (run_dir / "resume_ok_rank0").read_text() == "ok"


def test_load_on_one_process(run_dir: Path) -> None:
    ref = torch.load(run_dir / "ref_k_rank0.pt", weights_only=False)
    step, path = find_latest(run_dir / "sync")
    model, opt, sched = build(tie=True)
    torch.manual_seed(99)
    counters = load_role(
        path / "actor",
        RoleState(model=model, optimizer=opt, lr_scheduler=sched),
        ["model", "optimizer", "extra"],
    )
    assert step == K_STEPS and counters == {"global_step": K_STEPS}
    assert_identical(full_state(model, opt), ref["state"], "2 ranks -> 1 process")
    assert sched.state_dict() == ref["sched"]
    assert rng_equal(capture_rng(), ref["rng"])


def test_full_model_state_and_hf_weights_match(run_dir: Path) -> None:
    from safetensors.torch import load_file

    ref = torch.load(run_dir / "ref_k_rank0.pt", weights_only=False)["state"]
    ref_model = {k.removeprefix("model."): v for k, v in ref.items() if k.startswith("model.")}
    _, path = find_latest(run_dir / "sync")
    assert_identical(load_full_model_state(path / "actor" / "dist_ckpt"), ref_model, "DCP -> full state")
    # hf_model: gathered from the FSDP2 shards and written by rank 0 at save time
    saved_hf = load_file(path / "actor" / "huggingface" / "model.safetensors")
    assert_identical(saved_hf, ref_model, "hf_model safetensors")


def test_inspect_prints_manifest_and_tensors(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ckpt_cli(["inspect", str(run_dir / "sync")]) == 0
    out = capsys.readouterr().out
    assert "latest complete=global_step_2" in out and '"backend": "fsdp2"' in out
    assert "model.layers.0.up_proj.weight  [128, 64]  float32" in out
    assert "optimizer.state.layers.1.down_proj.weight.exp_avg  [64, 128]  float32" in out
    assert "optimizer.param_groups.embed_tokens.weight.lr" not in out  # plain values are not tensors
    assert '"lm_head.weight": "embed_tokens.weight"' in out  # the tied alias, in the manifest
    assert "model.embed_tokens.weight  [256, 64]" in out and "model.lm_head.weight" not in out
