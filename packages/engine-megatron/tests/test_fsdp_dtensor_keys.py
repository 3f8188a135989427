"""The fsdp_dtensor preprocessing resolves every checkpoint key of a bfloat16 model (CPU, one rank).

A bfloat16 engine wraps its GPTModel in a Float16Module inside the DDP / Megatron-FSDP wrapper. The model state
dict names parameters from a different level of that chain per wrapper: the DDP wrapper's
``state_dict_for_save_checkpoint`` hands out the GPTModel's names, while Megatron-FSDP replaces it by its own
``state_dict`` (names from the wrapper down). Megatron-Core's helpers resolve a model key as
``root.get_parameter("module." + key)`` and an optimizer key (a wrapper parameter name) as
``chunk.module.get_parameter(key minus one "module.")``. Megatron-FSDP itself needs CUDA; here both naming
conventions come from the DDP wrapper (``test_gpu_te.py`` saves a bf16 Megatron-FSDP checkpoint).
"""

from __future__ import annotations

import pytest
import torch


def test_bf16_model_and_optimizer_keys_resolve(megatron_env, tiny_qwen2):
    from megatron_cpu import make_engine

    from posttrain.megatron.fsdp_dtensor import model_key_root

    eng = make_engine(tiny_qwen2, dtype="bfloat16")
    chunk = eng.chunks[0]
    assert type(chunk.module).__name__ == "Float16Module"
    params = dict(chunk.named_parameters())
    by_id = {id(p) for p in params.values()}
    gpt_names = list(chunk.state_dict_for_save_checkpoint())  # the DDP wrapper: the GPTModel's names
    # Megatron-FSDP's convention: a wrapper whose state dict is nn.Module's over the Float16Module, which hands
    # up the GPTModel's names without a level of its own ("module.decoder...")
    fsdp_names = list(torch.nn.Module.state_dict(chunk))
    assert fsdp_names[0].startswith("module.") and not fsdp_names[0].startswith("module.module.")
    for names in (gpt_names, fsdp_names):
        keys = [k for k in names if not k.endswith("_extra_state")]
        assert len(keys) == len(params) > 0
        root = model_key_root(chunk, names)
        assert all(id(root.get_parameter(f"module.{k}")) in by_id for k in keys)
    with pytest.raises(ValueError, match="no model key names a parameter.*'nowhere.weight'"):
        model_key_root(chunk, ["nowhere.weight"])
    for name, param in params.items():
        assert chunk.module.get_parameter(name[len("module.") :]) is param
