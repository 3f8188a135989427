"""The megatron engine on one CPU process (TP=1) against Hugging Face references on packed data."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_log_probs_entropy_and_token_accuracy_equal_hf_on_packed_data(megatron_env, tiny_qwen2, packed_batch):
    from megatron_cpu import make_engine

    eng = make_engine(  # 3-token head chunks: every micro-batch spans several
        tiny_qwen2,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=16,
        forward_only=True,
        entropy_from_logits_chunk_size=3,
    )
    temperature = 0.7
    packed_batch.fields["temperature"] = torch.full((packed_batch.num_tokens,), temperature)
    packed_batch.meta["calculate_entropy"] = True
    with eng.eval_mode():
        out = eng.infer_batch(packed_batch)["model_output"]
    hf = _hf(tiny_qwen2)
    ref_lp, ref_ent = [], []
    with torch.no_grad():
        for seq in packed_batch.split_tokens(packed_batch.input_ids):
            logp = torch.log_softmax(hf(seq[None]).logits[0].double() / temperature, -1)[:-1]
            ref_lp.append(torch.cat([torch.zeros(1).double(), logp.gather(-1, seq[1:, None]).squeeze(-1)]))
            ref_ent.append(torch.cat([torch.zeros(1).double(), -(logp.exp() * logp).sum(-1)]))
    torch.testing.assert_close(out["log_probs"].double(), torch.cat(ref_lp), atol=2e-5, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), torch.cat(ref_ent), atol=2e-5, rtol=0)

    from posttrain.core.batch import PackedBatch
    from posttrain.core.testing import argmax_hits, half_greedy_sequences

    seqs = half_greedy_sequences(hf, [7, 12, 5, 9])  # token accuracy: HF's float64 argmax, token by token
    want = argmax_hits(hf, seqs)
    assert 0 < float(want.sum()) < want.numel() - len(seqs)
    batch = PackedBatch.from_sequences(
        seqs, [torch.ones(len(s)) for s in seqs], meta={"calculate_accuracy": True}
    )
    with eng.eval_mode():
        got = eng.infer_batch(batch)["model_output"]
    assert eng.computes_token_accuracy and "entropy" not in got
    torch.testing.assert_close(got["correct"].double(), want, atol=0, rtol=0)


def test_export_is_exact_hf_state_dict(megatron_env, tiny_qwen2):
    from megatron_cpu import make_engine

    eng = make_engine(tiny_qwen2, forward_only=True)
    stream, peft = eng.get_per_tensor_param()
    exported = {k: v.cpu() for k, v in stream}
    ref = _hf(tiny_qwen2).state_dict()
    assert peft is None
    assert sorted(exported) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(exported[name], tensor), name


def test_first_step_loss_grad_norm_and_update_equal_hf_reference(megatron_env, tiny_qwen2, packed_batch):
    from megatron_cpu import make_engine, nll_loss, reference_step

    ref_loss, ref_norm, ref_params = reference_step(tiny_qwen2, packed_batch, lr=1e-3, clip=1.0)
    eng = make_engine(tiny_qwen2, entropy_from_logits_chunk_size=4)  # head chunks recomputed in backward
    with eng.train_mode():
        out = eng.train_batch(packed_batch, nll_loss)
    assert len(out["loss"]) == 2  # 4 sequences, 2 per micro-batch
    assert sum(out["loss"]) == pytest.approx(ref_loss, abs=1e-5)
    assert out["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert ref_norm > 1.0  # the clip was active, so clipping is compared too
    exported = dict(eng.get_per_tensor_param()[0])
    for name, tensor in ref_params.items():
        # Adam's first step is ~lr * sign(grad): grads within fp32 noise of 0 may move differently, so
        # the tolerance is 1% of the step (a wrong update is off by ~lr = 1e-3).
        torch.testing.assert_close(exported[name].cpu(), tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_gradient_checkpointing_recomputes_each_layer_and_trains_alike(
    megatron_env, tiny_qwen2, packed_batch, checkpointing
):
    """``model.enable_gradient_checkpointing`` is Megatron's full per-layer recompute: every decoder layer
    runs forward twice per micro-batch with it (once without), and the step's loss, grad norm and update equal
    HF's."""
    from megatron_cpu import make_engine, nll_loss, reference_step

    ref_loss, ref_norm, ref_params = reference_step(tiny_qwen2, packed_batch, lr=1e-3, clip=1.0)
    eng = make_engine(tiny_qwen2, model_kw={"enable_gradient_checkpointing": checkpointing})
    assert eng.provider.recompute_granularity == ("full" if checkpointing else None)
    calls = []
    layers = [m for c in eng.chunks for m in c.modules() if type(m).__name__ == "TransformerLayer"]
    for layer in layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    with eng.train_mode():
        out = eng.train_batch(packed_batch, nll_loss)
    micro_batches = len(out["loss"])
    assert len(calls) == len(layers) * micro_batches * (2 if checkpointing else 1)
    assert sum(out["loss"]) == pytest.approx(ref_loss, abs=1e-5)
    assert out["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    exported = dict(eng.get_per_tensor_param()[0])
    for name, tensor in ref_params.items():
        torch.testing.assert_close(exported[name].cpu(), tensor, atol=1e-5, rtol=0, msg=name)


def test_chunked_head_with_entropy_trains_like_one_chunk(megatron_env, tiny_qwen2, packed_batch):
    """Loss = NLL - 0.1 entropy at temperature 0.8: 3-token head chunks (recomputed in backward) give the
    loss, grad norm and update of one chunk holding every token."""
    from megatron_cpu import make_engine, nll_loss

    def loss_fn(out, mb, ctx):
        nll, _ = nll_loss(out, mb, ctx)
        ent = (out["entropy"] * mb.loss_mask.to(nll.device)).sum() / ctx.global_num_tokens * ctx.dp_size
        return nll - 0.1 * ent, {}

    packed_batch.meta["calculate_entropy"] = True
    packed_batch.fields["temperature"] = torch.full((packed_batch.num_tokens,), 0.8)
    runs = []
    for chunk in (3, 4096):
        eng = make_engine(tiny_qwen2, entropy_from_logits_chunk_size=chunk)
        with eng.train_mode():
            out = eng.train_batch(packed_batch, loss_fn)
        runs.append((sum(out["loss"]), out["metrics"]["grad_norm"], dict(eng.get_per_tensor_param()[0])))
    (loss_a, norm_a, params_a), (loss_b, norm_b, params_b) = runs
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and norm_a == pytest.approx(norm_b, rel=1e-5)
    for name, tensor in params_b.items():
        torch.testing.assert_close(params_a[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_checkpoint_restores_model_and_optimizer(megatron_env, tiny_qwen2, packed_batch, tmp_path):
    from megatron_cpu import make_engine, nll_loss

    role_dir = tmp_path / "global_step_1" / "actor"
    first = make_engine(tiny_qwen2)
    with first.train_mode():
        first.train_batch(packed_batch, nll_loss)
        first.lr_scheduler_step()
        first.save_checkpoint(str(role_dir), global_step=1)
        first.train_batch(packed_batch, nll_loss)
    after_first = dict(first.get_per_tensor_param()[0])
    assert (role_dir / "dist_ckpt").is_dir() and (role_dir / "huggingface" / "config.json").is_file()

    second = make_engine(tiny_qwen2)
    assert second.load_checkpoint(str(role_dir)) == {"global_step": 1, "skipped_steps": 0}
    assert second._lr_step == 1
    with second.train_mode():
        second.train_batch(packed_batch, nll_loss)
    after_second = dict(second.get_per_tensor_param()[0])
    for name, tensor in after_first.items():  # equal only if Adam moments were restored too
        torch.testing.assert_close(after_second[name], tensor, atol=1e-7, rtol=0, msg=name)


def test_convert_round_trip_is_exact(megatron_env, tiny_qwen2, tmp_path):
    from safetensors.torch import load_file

    from posttrain.megatron.convert_cli import main

    assert main(["hf-to-megatron", "--hf-model", tiny_qwen2, "--output", str(tmp_path / "mc")]) == 0
    assert main(["megatron-to-hf", "--input", str(tmp_path / "mc"), "--output", str(tmp_path / "hf")]) == 0
    original = load_file(f"{tiny_qwen2}/model.safetensors")
    back = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_value_model_outputs_one_value_per_token_and_trains(megatron_env, tiny_qwen2, packed_batch):
    from megatron_cpu import make_engine

    eng = make_engine(tiny_qwen2, cls_name="MegatronValueModelEngine")
    returns = torch.linspace(-1, 1, packed_batch.num_tokens)

    def value_loss(out, micro, ctx):
        idx = torch.cat(
            [torch.arange(int(a), int(b)) for a, b in zip(micro.cu_seqlens[:-1], micro.cu_seqlens[1:])]
        )
        err = (out["values"] - micro.fields["returns"]) ** 2 * micro.loss_mask
        return err.sum() / ctx.global_num_tokens * ctx.dp_size, {"n": idx.numel()}

    packed_batch.fields["returns"] = returns
    with eng.train_mode():
        first = sum(eng.train_batch(packed_batch, value_loss)["loss"])
        for _ in range(5):
            last = sum(eng.train_batch(packed_batch, value_loss)["loss"])
        values = eng.infer_batch(packed_batch)["model_output"]["values"]
    assert values.shape == (packed_batch.num_tokens,)
    assert last < first


def test_hf_model_export_and_retention(megatron_env, tiny_qwen2, packed_batch, tmp_path):
    from megatron_cpu import make_engine, nll_loss
    from safetensors.torch import load_file

    from posttrain.core.config import CheckpointConfig

    ckpt = CheckpointConfig(save_contents=["model", "hf_model"])
    hf_save_kwargs = {"distributed_save": False}
    eng = make_engine(tiny_qwen2, ckpt=ckpt, hf_save_kwargs=hf_save_kwargs)
    with eng.train_mode():
        eng.train_batch(packed_batch, nll_loss)
    (tmp_path / "global_step_9" / "actor").mkdir(
        parents=True
    )  # a save that died: neither counted nor deleted
    for step in (1, 2, 3):
        eng.save_checkpoint(
            str(tmp_path / f"global_step_{step}" / "actor"), global_step=step, max_ckpt_to_keep=2
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3", "global_step_9"]
    hf_dir = tmp_path / "global_step_3" / "actor" / "huggingface"
    saved = {}
    for f in hf_dir.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    exported = dict(eng.get_per_tensor_param()[0])
    assert sorted(saved) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(saved[name], tensor.cpu()), name
