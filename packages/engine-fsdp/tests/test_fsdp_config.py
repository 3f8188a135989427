"""FSDPEngineConfig: its rules, and the knobs verl users bring (wrap_policy, the head's chunking and
checkpointing, full_determinism) doing what they say on a real engine."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_testing import make_batch, make_engine, pg_loss, save_tiny_model, tiny_config, train_step

from posttrain.core.config import CheckpointConfig, engine_config_class
from posttrain.fsdp.config import FSDP1EngineConfig, FSDP2EngineConfig, FSDPEngineConfig, WrapPolicy

LENGTHS = [5, 9, 3, 17, 1, 12]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("lm") / "model")


def test_backends_resolve_to_one_class_per_variant():
    assert engine_config_class("fsdp") is FSDP1EngineConfig
    assert engine_config_class("fsdp2") is FSDP2EngineConfig
    with pytest.raises(ValueError, match="FSDP1EngineConfig.strategy='fsdp2': use fsdp"):
        FSDP1EngineConfig(strategy="fsdp2")


def test_rules_name_the_fix():
    assert FSDPEngineConfig(dtype="bf16", model_dtype="fp32").model_dtype == "float32"
    with pytest.raises(ValueError, match="use fsdp or fsdp2"):
        FSDPEngineConfig(strategy="megatron")
    with pytest.raises(ValueError, match="fsdp_size=3 does not divide the world size 8"):
        FSDPEngineConfig(fsdp_size=3).check_world_size(8)
    assert FSDPEngineConfig(fsdp_size=4).check_world_size(8) == 8
    FSDPEngineConfig().check_checkpoint(CheckpointConfig(async_save=True))  # FSDP saves async


def test_wrap_policy_rules():
    with pytest.raises(ValueError, match="size-based wrapping is an FSDP1 auto-wrap policy"):
        FSDPEngineConfig(wrap_policy=WrapPolicy(min_num_params=10**6))
    FSDPEngineConfig(strategy="fsdp", wrap_policy=WrapPolicy(min_num_params=10**6))
    with pytest.raises(ValueError, match="wraps nothing"):
        WrapPolicy(transformer_layer_cls_to_wrap=[])
    with pytest.raises(ValueError, match="min_num_params=-1 must be >= 0"):
        WrapPolicy(min_num_params=-1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp1_units(path: str, **wrap) -> list[str]:
    """Class names of the FSDP1 units an fsdp engine makes on a one-rank gloo group."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        eng = make_engine(path, strategy="fsdp", wrap_policy=WrapPolicy(**wrap))
        assert type(eng.layout).__name__ == "FSDP1Layout"
        return sorted(type(m.module).__name__ for m in eng.module.modules() if isinstance(m, FSDP))
    finally:
        dist.destroy_process_group()


def test_wrap_policy_picks_the_fsdp1_units(lm_dir: str):
    layer, mlp, root = "Qwen2DecoderLayer", "Qwen2MLP", "Qwen2ForCausalLM"
    assert _fsdp1_units(lm_dir) == [layer, layer, root]  # the model's _no_split_modules
    assert _fsdp1_units(lm_dir, transformer_layer_cls_to_wrap=[mlp]) == [root, mlp, mlp]
    # size-based: each MLP (24.6k parameters) is a subtree of >= 20k, and so is the rest of the decoder
    assert _fsdp1_units(lm_dir, min_num_params=20_000) == [root, mlp, mlp, "Qwen2Model"]
    assert _fsdp1_units(lm_dir, transformer_layer_cls_to_wrap=["Qwen2MLP"]) == [
        "Qwen2ForCausalLM",
        "Qwen2MLP",
        "Qwen2MLP",
    ]
    assert _fsdp1_units(lm_dir, min_num_params=10**9) == [root]
    with pytest.raises(ValueError, match=r"names \['NoSuchLayer'\].*does not contain"):
        _fsdp1_units(lm_dir, transformer_layer_cls_to_wrap=["NoSuchLayer"])


def _saved_head_rows(path: str, **engine) -> list[int]:
    """Token rows of every (tokens, vocab) fp32 tensor autograd keeps from the training forward for
    backward."""
    config = tiny_config()
    rows: list[int] = []
    in_forward = [True]

    def pack(t: torch.Tensor) -> torch.Tensor:
        wide = t.dim() == 2 and t.shape[-1] == config.vocab_size and t.shape[0] != config.hidden_size
        if in_forward[0] and wide and t.dtype == torch.float32:
            rows.append(t.shape[0])
        return t

    def loss(out, mb, ctx):  # called between the forward and the backward of the micro-batch
        in_forward[0] = False
        return pg_loss(out, mb, ctx)

    eng = make_engine(path, **engine)
    with eng.train_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eng.forward_backward_batch(make_batch(LENGTHS), loss)
    return rows


def test_head_chunking_and_checkpointing_flags(lm_dir: str):
    total = sum(LENGTHS)
    chunks = [7] * (total // 7) + [total % 7]
    # checkpointed: only each chunk's logits are kept (the fp32 softmax is recomputed in backward)
    assert sorted(_saved_head_rows(lm_dir, entropy_from_logits_chunk_size=7), reverse=True) == chunks
    kept = _saved_head_rows(lm_dir, entropy_from_logits_chunk_size=7, entropy_checkpointing=False)
    assert len(kept) > 2 * len(chunks) and max(kept) == 7
    assert _saved_head_rows(lm_dir, entropy_from_logits_with_chunking=False) == [total]
    whole = _saved_head_rows(lm_dir, entropy_from_logits_with_chunking=False, entropy_checkpointing=False)
    assert len(whole) > 2 and set(whole) == {total}


@pytest.fixture
def restore_determinism(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = False


def _dropout_model(tmp_path: Path) -> str:
    from transformers import AutoModelForCausalLM

    config = tiny_config()
    config.attention_dropout = 0.3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "dropout"))
    return str(tmp_path / "dropout")


def test_full_determinism_repeats_a_step_bitwise(tmp_path: Path, restore_determinism) -> None:
    """Attention dropout draws from the global RNG: two steps match bitwise only if the engine seeds it."""
    import os

    path = _dropout_model(tmp_path)
    batch = make_batch(LENGTHS)

    def step(**engine):
        out = train_step(make_engine(path, **engine), batch, pg_loss)
        return out["loss"], out["params"]

    loss_a, params_a = step(full_determinism=True, seed=3)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    loss_b, params_b = step(full_determinism=True, seed=3)
    assert loss_a == loss_b
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    loss_c, _ = step(full_determinism=False)  # the RNG has moved on: other dropout masks
    assert loss_c != loss_a
