"""The torchtitan engine against Hugging Face and the FSDP engine, in one process on the CPU (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from titan_testing import load_hf, make_batch, make_engine, packed_and_hf_logits, pg_loss, save_tiny_model

from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
from posttrain.torchtitan.config import TorchTitanEngineConfig
from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine

LENGTHS = [7, 12, 3, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """Qwen3 with tied embeddings."""
    return save_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # head_dim 16: low, medium and high frequencies all occur
}


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "llama3.1"])
def test_logits_and_log_probs_equal_hf(model_type, tmp_path):
    """A packed row of four documents gives each document's HF logits (HF in fp32 on the CPU; the engine on
    its own device, fp32 there too), and the log-probs/entropy they imply (Qwen3 with tied embeddings, Llama-3
    without, Llama-3.1 with its RoPE scaling)."""
    extra = {"rope_scaling": LLAMA31_ROPE} if model_type == "llama3.1" else {}
    model_type = model_type.replace("3.1", "")
    model_dir = save_tiny_model(tmp_path, model_type, tie_word_embeddings=model_type == "qwen3", **extra)
    eng = make_engine(model_dir, forward_only=True)
    batch = make_batch(LENGTHS)
    cu = batch.cu_seqlens.tolist()
    logits, ref = packed_and_hf_logits(eng, load_hf(model_dir), batch)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)

    with eng.eval_mode():
        out = eng.infer_batch(batch)["model_output"]
    temp = batch.fields["temperature"]
    for a, b in zip(cu[:-1], cu[1:]):
        z = ref[a : b - 1] / temp[a + 1 : b, None]
        logp = F.log_softmax(z, -1)
        want = logp.gather(-1, batch.input_ids[a + 1 : b, None])[:, 0]
        torch.testing.assert_close(out["log_probs"][a + 1 : b], want, rtol=1e-5, atol=1e-5)
        entropy = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(out["entropy"][a + 1 : b], entropy, rtol=1e-5, atol=1e-5)
        assert out["log_probs"][a] == 0


def test_gradients_equal_fsdp_engine(model_dir):
    """One step's gradients (micro-batched, entropy bonus, temperatures) equal the FSDP engine's by HF
    name."""
    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    batch = make_batch(LENGTHS, seed=1)
    titan = make_engine(model_dir, max_token_len_per_gpu=20)
    fsdp = FSDPLanguageModelEngine(
        ModelConfig(path=model_dir),
        FSDP2EngineConfig(dtype="fp32", max_token_len_per_gpu=20),
        OptimizerConfig(lr=1e-3),
        CheckpointConfig(),
    )
    fsdp.initialize()
    with titan.train_mode(), fsdp.train_mode():
        got = titan.forward_backward_batch(batch, pg_loss)
        want = fsdp.forward_backward_batch(batch, pg_loss)
        assert len(got["loss"]) > 1  # several micro-batches
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        ref = dict(fsdp.module.named_parameters())
        grads = dict(titan.hf_module.named_parameters())
        assert set(grads) == set(ref)
        for name, p in grads.items():
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_token_accuracy_matches_hf_argmax(model_dir):
    """``correct`` (batch.meta['calculate_accuracy']) is HF's float64 argmax == token, token by token, over
    several logits chunks and micro-batches, with gradients on (the training path) and off; beside entropy."""
    from posttrain.core.batch import PackedBatch
    from posttrain.core.testing import argmax_hits, half_greedy_sequences

    hf = load_hf(model_dir)
    seqs = half_greedy_sequences(hf, LENGTHS + [20, 16])
    want = argmax_hits(hf, seqs)
    assert 0.3 < float(want.sum()) / (want.numel() - len(seqs)) < 0.8  # neither all hits nor none
    masks = [torch.ones(len(s)) for s in seqs]
    fields = {"advantages": [torch.ones(len(s)) for s in seqs]}
    meta = {"calculate_accuracy": True, "calculate_entropy": True}
    batch = PackedBatch.from_sequences(seqs, masks, fields, meta=meta)
    eng = make_engine(model_dir, entropy_from_logits_chunk_size=7, max_token_len_per_gpu=24)
    assert eng.computes_token_accuracy
    with eng.eval_mode():
        inferred = eng.infer_batch(batch)["model_output"]
    with eng.train_mode():
        eng.optimizer_zero_grad()
        trained = eng.forward_backward_batch(batch, pg_loss)["model_output"]
    for got in (inferred, trained):
        assert "entropy" in got
        torch.testing.assert_close(got["correct"].double(), want, atol=0, rtol=0)


def test_weight_stream_is_the_trained_hf_model(model_dir, tmp_path):
    """After a step, the rollout stream loads into the HF model with no key left over, and that model gives
    the engine's log-probs."""
    eng = make_engine(model_dir)
    batch = make_batch(LENGTHS, seed=2)
    with eng.train_mode():
        eng.train_batch(batch, pg_loss)
    stream, peft = eng.get_per_tensor_param(dtype="float32")
    assert peft is None
    state = dict(stream)
    hf = load_hf(model_dir)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    with eng.eval_mode():
        got = eng.infer_batch(batch)["model_output"]["log_probs"]
    cu = batch.cu_seqlens.tolist()
    a, b = cu[1], cu[2]
    with torch.no_grad():
        z = hf(batch.input_ids[a:b][None]).logits[0, :-1] / batch.fields["temperature"][a + 1 : b, None]
    want = F.log_softmax(z, -1).gather(-1, batch.input_ids[a + 1 : b, None])[:, 0]
    torch.testing.assert_close(got[a + 1 : b], want, rtol=1e-5, atol=1e-5)


def _engine(path: str, model: dict | None = None, **engine) -> TorchTitanLanguageModelEngine:
    return TorchTitanLanguageModelEngine(
        ModelConfig(path=path, **(model or {})),
        TorchTitanEngineConfig(**engine),
        OptimizerConfig(),
        CheckpointConfig(),
    )


def test_bad_settings_refused_with_the_fix(tmp_path):
    qwen2 = save_tiny_model(tmp_path / "q2", "qwen2")
    with pytest.raises(ValueError, match="no Qwen2 model.*model_engine=fsdp2"):
        _engine(qwen2)
    qwen3 = save_tiny_model(tmp_path / "q3", "qwen3")
    with pytest.raises(ValueError, match="lora_rank=8.*model.lora_rank=0"):
        _engine(qwen3, model={"lora_rank": 8})
    moe = save_tiny_model(
        tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    with pytest.raises(ValueError, match="tp_size=2 with the MoE model qwen3_moe.*set engine.tp_size=1"):
        _engine(moe, tp_size=2)
    yarn = save_tiny_model(tmp_path / "yarn", "llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type='yarn'.*model_engine=fsdp2"):
        _engine(yarn)
    with pytest.raises(ValueError, match="fsdp_size=3 does not divide the data-parallel size 4"):
        TorchTitanEngineConfig(fsdp_size=3).check_world_size(4)
    with pytest.raises(ValueError, match="fsdp_size=1 on 2 data-parallel ranks.*at least 2"):
        TorchTitanEngineConfig(fsdp_size=1).check_world_size(2)
    assert TorchTitanEngineConfig(tp_size=2, fsdp_size=2).check_world_size(8) == 4
    with pytest.raises(ValueError, match="tp_size=2 does not divide the world size 3"):
        TorchTitanEngineConfig(tp_size=2).check_world_size(3)
    # 4 query heads, 2 key/value heads: TP=4 would leave a rank without a key/value head
    with pytest.raises(
        ValueError, match=r"tp_size=4 does not divide .* 2 key/value heads: use a tp_size in \[1, 2\]"
    ):
        _engine(qwen3, tp_size=4)
    with pytest.raises(ValueError, match="tp_size=2 in a single process: launch 2 or more ranks"):
        _engine(qwen3, tp_size=2).initialize()


def test_fsdp2_checkpoint_resumes_on_torchtitan_and_exports_hf(tmp_path):
    """A role saved by the FSDP engine (model, optimizer, extra, hf_model) loads into the torchtitan engine
    with the same weights and AdamW moments; the torchtitan engine's own hf_model export is those weights."""
    from safetensors.torch import load_file

    from posttrain.fsdp.config import FSDP2EngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    path = save_tiny_model(tmp_path / "model")
    contents = ["model", "optimizer", "extra", "hf_model"]
    fsdp = FSDPLanguageModelEngine(
        ModelConfig(path=path),
        FSDP2EngineConfig(dtype="fp32", max_token_len_per_gpu=4096),
        OptimizerConfig(lr=1e-3),
        CheckpointConfig(save_contents=contents),
    )
    fsdp.initialize()
    with fsdp.train_mode():
        fsdp.train_batch(make_batch(LENGTHS, seed=3), pg_loss)
    fsdp.save_checkpoint(str(tmp_path / "a" / "global_step_1" / "actor"), global_step=1)
    want = dict(fsdp.get_per_tensor_param()[0])

    titan = make_engine(path)
    counters = titan.load_checkpoint(str(tmp_path / "a" / "global_step_1" / "actor"))
    assert counters["global_step"] == 1
    got = dict(titan.get_per_tensor_param()[0])
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    by_name = dict(titan.hf_module.named_parameters())
    ref = dict(fsdp.module.named_parameters())
    for name in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        torch.testing.assert_close(
            titan.optimizer.state[by_name[name]]["exp_avg"], fsdp.optimizer.state[ref[name]]["exp_avg"]
        )
    titan.checkpoint_config = CheckpointConfig(save_contents=contents)
    titan.save_checkpoint(str(tmp_path / "b" / "global_step_1" / "actor"), global_step=1)
    exported = load_file(
        str(tmp_path / "b" / "global_step_1" / "actor" / "huggingface" / "model.safetensors")
    )
    assert set(exported) == set(want)
    for name, value in want.items():  # the stream is on the engine's device, the file's tensors on the CPU
        torch.testing.assert_close(exported[name], value.cpu(), rtol=0, atol=0, msg=name)


def test_cuda_attention_follows_the_compute_dtype():
    """On CUDA only a bfloat16 compute dtype takes torchtitan's varlen kernel (it casts q/k/v to bfloat16);
    fp32 and fp16 take the per-document SDPA in their own dtype, with a warning that names the fix. Choosing
    builds configs only, so this runs without a GPU."""
    from posttrain.torchtitan.attention import PackedSDPA, inner_attention_config

    cuda = torch.device("cuda", 0)
    assert not isinstance(inner_attention_config(cuda, torch.bfloat16), PackedSDPA.Config)
    for dtype in (torch.float32, torch.float16):
        with pytest.warns(RuntimeWarning, match="engine.dtype=bfloat16"):
            assert isinstance(inner_attention_config(cuda, dtype), PackedSDPA.Config)
    assert isinstance(inner_attention_config(torch.device("cpu"), torch.bfloat16), PackedSDPA.Config)
