"""Tied parameters in one process: written once, aliases in the manifest, loads (also older checkpoints)
exact."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from ckpt_testlib import assert_identical, build, full_state, train_step

from posttrain.ckpt import RoleInfo, RoleState, load_full_model_state, load_role, save_role
from posttrain.ckpt.dist import single_process_dcp
from posttrain.ckpt.hf import dcp_tensor_metadata
from posttrain.ckpt.layout import dir_size
from posttrain.ckpt.role import _sharded_state
from posttrain.ckpt.tied import tied_aliases

CONTENTS = ["model", "optimizer", "extra"]


def _trained_tied() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model, opt, sched = build(tie=True)
    for s in (1, 2):
        train_step(model, opt, sched, s, 0)
    return model, opt, sched


def _save_legacy(role_dir: Path, state: RoleState) -> None:
    """A role directory as written before deduplication: every name in DCP, no tied_aliases (and no checksums,
    which came later) in the manifest."""
    save_role(role_dir, state, RoleInfo(), CONTENTS, 2)
    manifest = json.loads((role_dir / "manifest.json").read_text())
    del manifest["tied_aliases"], manifest["checksums"]
    (role_dir / "manifest.json").write_text(json.dumps(manifest))
    for f in (role_dir / "dist_ckpt").glob("*.distcp"):
        f.unlink()
    (role_dir / "dist_ckpt" / ".metadata").unlink()
    with single_process_dcp():
        dcp.save(_sharded_state(state, CONTENTS), checkpoint_id=str(role_dir / "dist_ckpt"), no_dist=True)


def test_tied_weight_written_once_and_restored(tmp_path: Path) -> None:
    model, opt, sched = _trained_tied()
    assert tied_aliases(model, ["embed_tokens.weight", "lm_head.weight"]) == {
        "lm_head.weight": "embed_tokens.weight"
    }
    ref = full_state(model, opt)
    state = RoleState(model=model, optimizer=opt, lr_scheduler=sched)
    save_role(tmp_path / "new", state, RoleInfo(), CONTENTS, 2)
    _save_legacy(tmp_path / "old", state)

    manifest = json.loads((tmp_path / "new" / "manifest.json").read_text())
    assert manifest["tied_aliases"] == {"lm_head.weight": "embed_tokens.weight"}
    keys = dcp_tensor_metadata(tmp_path / "new" / "dist_ckpt")
    assert "model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    saved = dir_size(tmp_path / "old" / "dist_ckpt") - dir_size(tmp_path / "new" / "dist_ckpt")
    assert saved >= model.embed_tokens.weight.numel() * 4, saved

    for variant in ("new", "old"):  # deduplicated, and a checkpoint written before deduplication
        fresh, fresh_opt, fresh_sched = build(tie=True, lr=0.5)
        load_role(
            tmp_path / variant,
            RoleState(model=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched),
            CONTENTS,
        )
        assert fresh.lm_head.weight is fresh.embed_tokens.weight
        assert_identical(full_state(fresh, fresh_opt), ref, variant)
        train_step(fresh, fresh_opt, fresh_sched, 3, 0)
        assert fresh.lm_head.weight is fresh.embed_tokens.weight

    full = load_full_model_state(tmp_path / "new" / "dist_ckpt")
    assert_identical(
        full, {k.removeprefix("model."): v for k, v in ref.items() if k.startswith("model.")}, "full"
    )
    assert full["lm_head.weight"] is full["embed_tokens.weight"]


def test_tied_checkpoint_loads_into_untied_model(tmp_path: Path) -> None:
    model, opt, sched = _trained_tied()
    save_role(
        tmp_path / "actor", RoleState(model=model, optimizer=opt), RoleInfo(), ["model", "optimizer"], 2
    )
    untied, _, _ = build(tie=False)
    load_role(tmp_path / "actor", RoleState(model=untied), ["model"])
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    for k, v in model.state_dict().items():
        assert torch.equal(untied.state_dict()[k], v), k
