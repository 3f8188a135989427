"""LoRA roles: a tiny tied Qwen2 with a peft adapter, saved through save_role, exported merged and
adapter-only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_testlib import make_model_dir, train_step

from posttrain.ckpt import RoleInfo, RoleState, export_hf, save_role
from posttrain.ckpt.cli import main as ckpt_cli
from posttrain.ckpt.lora import merge_lora

CONTENTS = ["model", "optimizer", "extra", "hf_model"]
IDS = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(5))


def _peft_model(model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    model = get_peft_model(base, config)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapter change the output
            torch.nn.init.normal_(p, std=0.05)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


@pytest.mark.slow
def test_lora_export_merges_like_merge_and_unload(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_model_dir(tmp_path / "model", tie=True)
    model, opt = _peft_model(model_dir)
    train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 1, 0)
    info = RoleInfo(hf_config=AutoConfig.from_pretrained(model_dir), model_dir=str(model_dir))
    role = tmp_path / "actor"
    save_role(role, RoleState(model=model, optimizer=opt), info, CONTENTS, 1)
    manifest = json.loads((role / "manifest.json").read_text())
    assert manifest["peft_config"]["default"]["lora_alpha"] == 12
    assert manifest["tied_aliases"] == {
        "base_model.model.lm_head.weight": "base_model.model.model.embed_tokens.weight"
    }

    adapted = _logits(model)
    assert ckpt_cli(["export-hf", str(role), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert torch.equal(_logits(PeftModel.from_pretrained(base, tmp_path / "adapter")), adapted)

    merged = _logits(model.merge_and_unload())
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert not torch.allclose(merged, _logits(plain), atol=1e-3)  # the adapter matters
    assert ckpt_cli(["export-hf", str(role), str(tmp_path / "hf")]) == 0
    for hf_dir in (tmp_path / "hf", role / "huggingface"):  # the export, and hf_model written at save time
        exported = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
        assert torch.equal(_logits(exported), merged), hf_dir


def test_lora_export_errors_name_the_fix(tmp_path: Path) -> None:
    state = {
        "base_model.model.l.base_layer.weight": torch.zeros(2, 2),
        "base_model.model.l.lora_A.default.weight": torch.zeros(1, 2),
    }
    with pytest.raises(ValueError, match="export with --adapter-only"):
        merge_lora(state, {"default": {"peft_type": "LORA", "lora_alpha": 8, "use_dora": True}})
    with pytest.raises(ValueError, match="merges exactly one"):
        merge_lora(state, {"a": {"lora_alpha": 8}, "b": {"lora_alpha": 8}})
    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a DCP checkpoint"):
        export_hf(tmp_path, tmp_path / "out", adapter_only=True)
