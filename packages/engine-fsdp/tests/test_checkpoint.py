"""FSDP engine checkpoints in one process: bitwise resume through the step manager, async save, HF export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_testing import make_batch, make_engine, pg_loss, save_tiny_model

from posttrain.ckpt import CheckpointManager
from posttrain.ckpt.cli import main as ckpt_cli
from posttrain.core.config import CheckpointConfig
from posttrain.fsdp.checkpoint import load_fsdp_checkpoint, save_fsdp_checkpoint

CONTENTS = ["model", "optimizer", "extra", "hf_model"]


def _engine(path: str, **ckpt) -> object:
    eng = make_engine(path, lr=1e-2)
    eng.checkpoint_config = CheckpointConfig(save_contents=CONTENTS, **ckpt)
    return eng


def _step(eng, i: int) -> list[float]:
    with eng.train_mode():
        out = eng.train_batch(make_batch([7, 12, 5], seed=100 + i), pg_loss)
        eng.lr_scheduler_step()
    return [float(loss) for loss in out["loss"]] + [out["metrics"]["grad_norm"]]


def _params(eng) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


@pytest.mark.slow
def test_engine_bitwise_resume_and_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "lm")
    eng = _engine(path)
    for i in range(2):
        _step(eng, i)
    mgr = CheckpointManager(tmp_path / "ckpt", eng.checkpoint_config)
    staging = mgr.stage(2)
    eng.save_checkpoint(str(staging / "actor"), global_step=2)
    mgr.commit(2)
    losses = [_step(eng, i) for i in (2, 3)]

    resumed = _engine(path)
    step, step_dir = mgr.latest()
    counters = resumed.load_checkpoint(str(step_dir / "actor"))  # the engine returns the saved counters
    assert step == 2 and counters == {"global_step": 2, "skipped_steps": 0}
    for i, want in zip((2, 3), losses):
        assert _step(resumed, i) == want
    want_params = _params(eng)
    assert all(torch.equal(v, want_params[k]) for k, v in _params(resumed).items())

    assert ckpt_cli(["export-hf", str(step_dir / "actor"), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    at_step2 = _engine(path)
    load_fsdp_checkpoint(at_step2, str(step_dir / "actor"))
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, at_step2.module.eval()(input_ids=ids).logits)


def test_async_save_through_the_engine_hook(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "lm")
    eng = _engine(path, async_save=True)
    _step(eng, 0)
    mgr = CheckpointManager(tmp_path / "ckpt", eng.checkpoint_config)
    staging = mgr.stage(1)
    with pytest.raises(ValueError, match="writer=manager.writer"):
        save_fsdp_checkpoint(eng, str(staging / "actor"), 1)
    saved = _params(eng)
    save_fsdp_checkpoint(eng, str(staging / "actor"), 1, writer=mgr.writer)
    mgr.commit(1)
    _step(eng, 1)  # parameters change while the checkpoint is written
    mgr.close()
    fresh = _engine(path)
    load_fsdp_checkpoint(fresh, str(mgr.latest()[1] / "actor"))
    assert all(torch.equal(v, saved[k]) for k, v in _params(fresh).items())


@pytest.mark.slow
def test_save_checkpoint_keeps_the_newest_saves_of_its_role(tmp_path: Path) -> None:
    """``save_checkpoint(<root>/global_step_<N>/actor, max_ckpt_to_keep=2)`` prunes the older finished saves
    (a save that died before its manifest is neither counted nor deleted); ``checkpoint.max_ckpt_to_keep`` is
    the default; a save into a step manager's staging directory leaves retention to the manager."""
    eng = _engine(save_tiny_model(tmp_path / "lm"), max_ckpt_to_keep=1)
    root = tmp_path / "run"
    (root / "global_step_9" / "actor").mkdir(parents=True)  # died mid-save: no manifest
    for step in (1, 2, 3):
        eng.save_checkpoint(str(root / f"global_step_{step}" / "actor"), global_step=step, max_ckpt_to_keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "global_step_3", "global_step_9"]
    eng.save_checkpoint(str(root / "global_step_4" / "actor"), global_step=4)  # the config's 1
    assert sorted(p.name for p in root.iterdir()) == ["global_step_4", "global_step_9"]
    eng.save_checkpoint(str(root / ".tmp.global_step_5" / "actor"), global_step=5)
    assert (root / "global_step_4").is_dir()
