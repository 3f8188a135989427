"""HF side in one process: a tiny Qwen2 saved with hf_model, exported with the CLI, loaded by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_testlib import build, make_model_dir, train_step

from posttrain.ckpt import CheckpointManager, RoleInfo, RoleState, save_role
from posttrain.ckpt.cli import main as ckpt_cli
from posttrain.ckpt.hf import write_safetensors
from posttrain.core.config import CheckpointConfig

CONTENTS = ["model", "optimizer", "extra", "hf_model"]


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_hf_gives_identical_logits(tmp_path: Path, tie: bool) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_model_dir(tmp_path / "model", tie=tie)
    model, opt, sched = build(model_dir)
    train_step(model, opt, sched, 1, 0)
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(save_contents=CONTENTS))
    staging = mgr.stage(1)
    info = RoleInfo(
        backend="torch", hf_config=AutoConfig.from_pretrained(model_dir), model_dir=str(model_dir)
    )
    save_role(staging / "actor", RoleState(model=model, optimizer=opt, lr_scheduler=sched), info, CONTENTS, 1)
    mgr.commit(1)
    role = tmp_path / "ckpt" / "global_step_1" / "actor"

    assert ckpt_cli(["export-hf", str(role), str(tmp_path / "hf")]) == 0
    model.eval()
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for hf_dir in (
            tmp_path / "hf",
            role / "huggingface",
        ):  # the export, and hf_model written at save time
            exported = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
            assert torch.equal(exported(input_ids=ids).logits, expected), hf_dir
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode("w1 w7").ids == [1, 7]
    assert (tmp_path / "hf" / "generation_config.json").is_file()
    assert ckpt_cli(["export-hf", str(role), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_safetensors_shards_and_index(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = {f"w{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    names = write_safetensors(tmp_path, state, max_shard_bytes=2048)
    assert names[-1] == "model.safetensors.index.json" and len(names) == 4
    loaded = {}
    for name in names[:-1]:
        loaded.update(load_file(tmp_path / name))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
