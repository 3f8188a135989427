"""Offline model init: the tiny model loads, has head_dim 64, and its tokenizer round-trips with a chat
template."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.core.config import ModelConfig
from posttrain.trainers.commands import model_cmd
from posttrain.trainers.model_init import IM_END, PAD, count_parameters


def test_model_init_tiny(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert model_cmd.main(["init", "--arch", "qwen2", "--size", "tiny", "--out", str(out)]) == 0
    assert "parameters) to" in capsys.readouterr().out
    ModelConfig(path=str(out)).require_weights()  # a random model on purpose has its weights on disk
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = model.config
    assert cfg.head_dim == 64 and cfg.hidden_size == 128 and cfg.num_key_value_heads == 1
    assert cfg.vocab_size >= len(tok) and cfg.vocab_size % 64 == 0
    assert tok.eos_token == IM_END and tok.pad_token == PAD and cfg.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert count_parameters(out) == sum(p.numel() for p in model.parameters()) < 1_000_000
    text = "Ünïcode ✓ and 12345 + 678 = ?\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok("2024", add_special_tokens=False)["input_ids"]] == [
        "2",
        "0",
        "2",
        "4",
    ]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()
    # the same seed gives the same weights and tokenizer
    again = tmp_path / "again"
    model_cmd.main(["init", "--size", "tiny", "--out", str(again)])
    assert (again / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            model.state_dict().values(), AutoModelForCausalLM.from_pretrained(again).state_dict().values()
        )
    )


def test_model_init_refuses_nonempty_dir(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep")
    with pytest.raises(ValueError, match="exists and is not empty"):
        model_cmd.main(["init", "--size", "tiny", "--out", str(tmp_path / "x")])


def test_extend_vocab_fills_exactly_and_round_trips():
    from posttrain.trainers.model_init import build_tokenizer, extend_vocab

    small = build_tokenizer(384)
    big = extend_vocab(small, 70_000)  # past the 65,536 byte pairs: some pair + byte merges too
    assert len(big) == 70_000 and big.eos_token == IM_END and big.pad_token == PAD
    assert all(t is not None for t in big.convert_ids_to_tokens(list(range(len(big)))))
    text = "Ünïcode ✓ and 12345 + 678 = ?\n"
    ids = big(text, add_special_tokens=False)["input_ids"]
    assert big.decode(ids) == text and max(ids) >= len(small)  # the new merges are used
    assert (
        big("2024", add_special_tokens=False)["input_ids"]
        == small("2024", add_special_tokens=False)["input_ids"]
    )
    assert big.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ) == small.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="below the"):
        extend_vocab(small, 100)


def test_qwen25_shapes():
    from transformers import AutoModelForCausalLM

    from posttrain.trainers.model_init import build_tokenizer, extend_vocab, model_config

    tok = extend_vocab(build_tokenizer(384), 151_936)
    expect = {"0.5b": (896, 24, 14, 64, 494_032_768), "1.5b": (1536, 28, 12, 128, 1_543_714_304)}
    for size, (hidden, layers, heads, head_dim, params) in expect.items():
        cfg = model_config("qwen2", size, tok)
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (
            hidden,
            layers,
            heads,
            head_dim,
        )
        assert cfg.vocab_size == 151_936 and cfg.num_key_value_heads == 2
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert sum(p.numel() for p in model.parameters()) == params  # Qwen2.5-0.5B / -1.5B's published counts


def test_qwen3_0_6b_shape():
    from transformers import AutoModelForCausalLM

    from posttrain.trainers.model_init import build_tokenizer, extend_vocab, model_config

    cfg = model_config("qwen3", "0.6b", extend_vocab(build_tokenizer(384), 151_936))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == ("qwen3", 1024, 28, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (16, 8, 3072)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920  # Qwen3-0.6B's count (tied embeddings)


def test_qwen3_moe_tiny(tmp_path):
    """``--arch qwen3_moe``: every layer's MLP is MOE_EXPERTS experts of a quarter width, top-MOE_TOP_K
    routed."""
    from posttrain.trainers.model_init import MOE_EXPERTS, MOE_TOP_K, SIZES

    out = tmp_path / "moe"
    assert model_cmd.main(["init", "--arch", "qwen3_moe", "--size", "tiny", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", MOE_EXPERTS, MOE_TOP_K)
    assert cfg.moe_intermediate_size == SIZES["tiny"].intermediate_size // 4 and cfg.norm_topk_prob
    assert cfg.decoder_sparse_step == 1 and not cfg.mlp_only_layers  # every layer is sparse
    assert count_parameters(out) == sum(p.numel() for p in model.parameters())
    ids = AutoTokenizer.from_pretrained(out)("12 + 3 = ?", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()
