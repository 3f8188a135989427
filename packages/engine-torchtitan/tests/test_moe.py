"""Qwen3-MoE on the torchtitan engine against Hugging Face's model of the same checkpoint (fp32, CPU): logits,
the per-expert HF weight stream, and one step's gradients."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from titan_testing import load_hf, make_batch, make_engine, packed_and_hf_logits, pg_loss, save_tiny_model

from posttrain.core.batch import PackedBatch

LENGTHS = [7, 12, 3, 9]
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    norm_topk_prob=True,
    mlp_only_layers=[1],  # layer 1 dense (intermediate_size), layers 0 and 2 sparse
    num_hidden_layers=3,
    head_dim=32,
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", **MOE)


def _hf_log_probs(hf, batch: PackedBatch) -> torch.Tensor:
    """Per-token log-probs (0 at each document's first token) of HF's model, one document at a time."""
    cu = batch.cu_seqlens.tolist()
    temp = batch.fields["temperature"]
    out = torch.zeros(batch.num_tokens)
    for a, b in zip(cu[:-1], cu[1:]):
        z = hf(batch.input_ids[a:b][None]).logits[0, :-1] / temp[a + 1 : b, None]
        logp = F.log_softmax(z, -1).gather(-1, batch.input_ids[a + 1 : b, None])[:, 0]
        out = out.index_put((torch.arange(a + 1, b),), logp)
    return out


def test_logits_equal_hf(moe_dir):
    eng = make_engine(moe_dir, forward_only=True)
    assert [b.moe_enabled for b in eng.module.layers.values()] == [True, False, True]
    logits, ref = packed_and_hf_logits(eng, load_hf(moe_dir), make_batch(LENGTHS))
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_weight_stream_is_hf_per_expert(moe_dir, tmp_path):
    """Before training the stream is the checkpoint's safetensors, name for name (one tensor per expert);
    after a step it saves as an HF directory whose model gives the engine's log-probs."""
    from safetensors.torch import load_file, save_file

    eng = make_engine(moe_dir)
    disk = load_file(f"{moe_dir}/model.safetensors")
    got = {k: v.cpu() for k, v in eng.get_per_tensor_param()[0]}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in got
    assert set(got) == set(disk)
    for name, value in disk.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)

    batch = make_batch(LENGTHS, seed=2)
    with eng.train_mode():
        eng.train_batch(batch, pg_loss)
    trained = {k: v.cpu().contiguous() for k, v in eng.get_per_tensor_param(dtype="float32")[0]}
    shutil.copy(f"{moe_dir}/config.json", tmp_path / "config.json")
    save_file(trained, str(tmp_path / "model.safetensors"))
    with eng.eval_mode():
        want = eng.infer_batch(batch)["model_output"]["log_probs"]
    with torch.no_grad():
        ref = _hf_log_probs(load_hf(str(tmp_path)), batch)
    assert not torch.equal(trained["model.layers.0.mlp.experts.1.up_proj.weight"],
                           disk["model.layers.0.mlp.experts.1.up_proj.weight"])  # fmt: skip
    torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-5)


def _hf_grads(hf) -> dict[str, torch.Tensor]:
    """HF's gradients under the engine's HF view names (HF fuses gate and up: ``experts.gate_up_proj``)."""
    out = {}
    for name, p in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "w1_EFD")] = gate
            out[name.replace("gate_up_proj", "w3_EFD")] = up
        elif name.endswith("experts.down_proj"):
            out[name.replace("down_proj", "w2_EDF")] = p.grad
        elif name != "lm_head.weight":  # tied to the embeddings
            out[name] = p.grad
    return out


def test_gradients_equal_hf(moe_dir):
    """One step (several micro-batches, entropy off) gives HF's gradients for every parameter, experts and
    router included."""
    batch = make_batch(LENGTHS, seed=1)
    batch.meta["calculate_entropy"] = False
    eng = make_engine(moe_dir, max_token_len_per_gpu=20)
    with eng.train_mode():  # gradients are dropped when the mode exits
        got = eng.forward_backward_batch(batch, pg_loss)
        grads = {k: p.grad.cpu() for k, p in eng.hf_module.named_parameters()}
    assert len(got["loss"]) > 1
    hf = load_hf(moe_dir)
    logp = _hf_log_probs(hf, batch)
    mask = batch.loss_mask
    loss = (-logp * batch.fields["advantages"] * mask).sum() / mask.sum()
    loss.backward()
    assert sum(got["loss"]) == pytest.approx(loss.item(), rel=1e-5)
    want = _hf_grads(hf)
    assert set(grads) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpoint_resumes_on_torchtitan_only(moe_dir, tmp_path):
    """A MoE role (grouped experts) saved after a step loads into a fresh engine with the same weights and
    AdamW moments; hf_model is refused for it, and a MoE role the FSDP engine saved is refused by name."""
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine
    from posttrain.torchtitan.config import TorchTitanEngineConfig
    from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine

    eng = make_engine(moe_dir)
    with eng.train_mode():
        eng.train_batch(make_batch(LENGTHS, seed=3), pg_loss)
    role = tmp_path / "run" / "global_step_1" / "actor"
    eng.save_checkpoint(str(role), global_step=1)
    other = make_engine(moe_dir)
    assert other.load_checkpoint(str(role))["global_step"] == 1
    want = dict(eng.get_per_tensor_param()[0])
    got = dict(other.get_per_tensor_param()[0])
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    name = "model.layers.2.mlp.experts.w3_EFD"
    mine, theirs = (
        dict(eng.hf_module.named_parameters())[name],
        dict(other.hf_module.named_parameters())[name],
    )
    torch.testing.assert_close(other.optimizer.state[theirs]["exp_avg"], eng.optimizer.state[mine]["exp_avg"])

    contents = ["model", "optimizer", "extra", "hf_model"]
    with pytest.raises(ValueError, match="hf_model.*MoE model.*drop hf_model"):
        TorchTitanLanguageModelEngine(
            ModelConfig(path=moe_dir),
            TorchTitanEngineConfig(dtype="fp32"),
            OptimizerConfig(),
            CheckpointConfig(save_contents=contents),
        )
    fsdp = FSDPLanguageModelEngine(
        ModelConfig(path=moe_dir), FSDP2EngineConfig(dtype="fp32"), OptimizerConfig(), CheckpointConfig()
    )
    fsdp.initialize()
    fsdp.save_checkpoint(str(tmp_path / "fsdp" / "global_step_1" / "actor"), global_step=1)
    with pytest.raises(ValueError, match="saved by backend 'torch'.*model_engine=fsdp2"):
        other.load_checkpoint(str(tmp_path / "fsdp" / "global_step_1" / "actor"))


def test_bad_expert_parallel_settings_refused(moe_dir, tmp_path):
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.torchtitan.config import TorchTitanEngineConfig
    from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine

    def engine(path: str, **cfg):
        return TorchTitanLanguageModelEngine(
            ModelConfig(path=path), TorchTitanEngineConfig(**cfg), OptimizerConfig(), CheckpointConfig()
        )

    dense = save_tiny_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ValueError, match="ep_size=2 on the dense model qwen3.*set engine.ep_size=1"):
        engine(dense, ep_size=2)
    with pytest.raises(
        ValueError, match=r"ep_size=3 does not divide the model's 4 experts: use one of \[1, 2, 4\]"
    ):
        engine(moe_dir, ep_size=3)
    with pytest.raises(ValueError, match="ep_size=2 in a single process: launch 2 or more ranks"):
        engine(moe_dir, ep_size=2).initialize()
    with pytest.raises(ValueError, match="ep_size=2 with engine.tp_size=2.*set engine.tp_size=1"):
        TorchTitanEngineConfig(ep_size=2, tp_size=2)
    with pytest.raises(ValueError, match="ep_size=4 does not divide the FSDP shard group of 2 ranks"):
        TorchTitanEngineConfig(ep_size=4, fsdp_size=2).check_world_size(4)
    assert TorchTitanEngineConfig(ep_size=2, fsdp_size=4).check_world_size(8) == 8
