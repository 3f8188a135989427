"""The fsdp_dtensor preprocessing resolves every checkpoint key of a bfloat16 model (CPU, one rank).

A bfloat16 engine wraps its GPTModel in a Float16Module inside the DDP / Megatron-FSDP wrapper, while the
model state dict (``state_dict_for_save_checkpoint``) names parameters as the GPTModel does. Megatron-Core's
helpers resolve a model key as ``root.get_parameter("module." + key)`` and an optimizer key (a wrapper
parameter name) as ``chunk.module.get_parameter(key minus one "module.")``. Megatron-FSDP itself needs CUDA;
the key structure is the DDP wrapper's here, the same Float16Module in between (``test_gpu_te.py`` saves the
Megatron-FSDP checkpoint).
"""

from __future__ import annotations


def test_bf16_model_and_optimizer_keys_resolve(megatron_env, tiny_qwen2):
    from megatron_cpu import make_engine

    from posttrain.megatron.fsdp_dtensor import model_key_root

    eng = make_engine(tiny_qwen2, dtype="bfloat16")
    chunk = eng.chunks[0]
    assert type(chunk.module).__name__ == "Float16Module"
    keys = [k for k in chunk.state_dict_for_save_checkpoint() if not k.endswith("_extra_state")]
    params = dict(chunk.named_parameters())
    assert len(keys) == len(params) > 0
    root = model_key_root(chunk)
    by_id = {id(p) for p in params.values()}
    assert all(id(root.get_parameter(f"module.{k}")) in by_id for k in keys)
    # the wrapper itself is the wrong root for model keys (what the save used before: it failed on the GPU)
    try:
        chunk.get_parameter(f"module.{keys[0]}")
    except AttributeError as exc:
        assert "Float16Module" in str(exc)
    else:
        raise AssertionError(
            "model keys resolved against the wrapper: the test no longer covers the Float16Module"
        )
    for name, param in params.items():
        assert chunk.module.get_parameter(name[len("module.") :]) is param
