"""The torchtitan value model (PPO critic) against the FSDP engine's on the same token-classification
checkpoint:
values per token and one step's gradients by HF name (fp32, one process)."""

from __future__ import annotations

import pytest
import torch
from titan_testing import make_batch, tiny_hf_config

from posttrain.core.batch import LossContext, PackedBatch
from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig

LENGTHS = [7, 12, 3, 9]


def value_loss(out: dict[str, torch.Tensor], mb: PackedBatch, ctx: LossContext) -> tuple[torch.Tensor, dict]:
    """Masked squared error against the advantages as returns (global token normalisation)."""
    err = (out["values"] - mb.fields["advantages"]) ** 2
    return (err * mb.loss_mask).sum() / ctx.global_num_tokens * ctx.dp_size, {}


def _engines(path: str, **engine):
    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPValueModelEngine
    from posttrain.torchtitan.config import TorchTitanEngineConfig
    from posttrain.torchtitan.engine import TorchTitanValueModelEngine

    common = {"dtype": "fp32", "max_token_len_per_gpu": 20, **engine}
    titan = TorchTitanValueModelEngine(
        ModelConfig(path=path), TorchTitanEngineConfig(**common), OptimizerConfig(lr=1e-3), CheckpointConfig()
    )
    fsdp = FSDPValueModelEngine(
        ModelConfig(path=path), FSDP2EngineConfig(**common), OptimizerConfig(lr=1e-3), CheckpointConfig()
    )
    titan.initialize()
    fsdp.initialize()
    return titan, fsdp


def test_values_and_gradients_equal_fsdp_critic(tmp_path):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    hf = AutoModelForTokenClassification.from_config(tiny_hf_config("qwen3", tie=False, num_labels=1))
    with torch.no_grad():
        hf.score.bias.fill_(0.25)  # a non-zero bias, so a dropped bias shows
    hf.save_pretrained(tmp_path)
    titan, fsdp = _engines(str(tmp_path))
    batch = make_batch(LENGTHS)
    with titan.eval_mode(), fsdp.eval_mode():
        got = titan.infer_batch(batch)["model_output"]["values"]
        want = fsdp.infer_batch(batch)["model_output"]["values"]
    assert got.shape == (batch.num_tokens,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with titan.train_mode(), fsdp.train_mode():
        loss = titan.forward_backward_batch(batch, value_loss)["loss"]
        assert len(loss) > 1  # several micro-batches
        assert loss == pytest.approx(fsdp.forward_backward_batch(batch, value_loss)["loss"], rel=1e-5)
    ref = dict(fsdp.module.named_parameters())
    grads = dict(titan.hf_module.named_parameters())
    assert set(grads) == set(ref) and "score.bias" in grads
    for name, p in grads.items():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)
