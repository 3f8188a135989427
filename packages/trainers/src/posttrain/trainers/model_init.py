"""Offline model initialisation: a random-init Hugging Face model and a chat tokenizer, with no downloads.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on a synthetic corpus
(:func:`posttrain.trainers.data.synthetic.tokenizer_corpus`): digits are split one per token (so arithmetic is
learnable), the 256 byte symbols are always in the vocabulary (any text encodes), and ChatML special tokens
``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) are added. It is wrapped as a
``PreTrainedTokenizerFast`` with a ChatML chat template. The corpus only supports about 440 tokens; a larger
vocabulary (``0.5b`` and ``1.5b`` take Qwen2.5's 151,936) is filled with synthetic byte-pair merges of the
byte alphabet (pairs first, then pair + byte), ranked after the trained ones; every id decodes to bytes and
digits stay one token each. The model is built with ``AutoModelForCausalLM.from_config``
under a fixed seed, its vocabulary rounded up to a multiple of 64.
Sizes: ``tiny`` (hidden 128, 2 heads of head_dim 64, 1 KV head, 2 layers: about 0.35 M parameters, so SFT and
GRPO run in minutes on two CPU cores; head_dim 64 is what vLLM's CPU attention accepts), ``small``, and the
shapes of Qwen2.5-0.5B (``0.5b``: hidden 896, 24 layers, 14 heads, 2 KV heads, 494 M parameters) and
Qwen2.5-1.5B (``1.5b``: hidden 1536, 28 layers, 12 heads, 2 KV heads, 1.54 B parameters) with random weights,
for benchmarks; ``0.6b`` is the shape of Qwen3-0.6B (hidden 1024, 28 layers, 16 heads of head_dim 128, 8 KV
heads). ``--arch`` is ``qwen2``, ``qwen3`` (Qwen3 adds per-head q/k norms; the torchtitan engine builds Qwen3)
or ``qwen3_moe`` (Qwen3 with every MLP a mixture of :data:`MOE_EXPERTS` experts, top-:data:`MOE_TOP_K` routing
with normalised weights, each expert a quarter of the size's ``intermediate_size``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import torch

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen2 uses it (without the default system turn)."""


@dataclass(frozen=True)
class ModelSize:
    """Shape of one preset size."""

    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Query heads (head_dim = hidden_size / heads)."""
    num_key_value_heads: int
    """KV heads (grouped-query attention)."""
    num_hidden_layers: int
    """Decoder layers."""
    intermediate_size: int
    """MLP width."""
    vocab_size: int
    """Tokenizer training target (byte alphabet + merges + specials); the corpus stops it near 444."""
    pad_vocab_to: int | None = None
    """Fill the tokenizer with synthetic merges up to exactly this many tokens (None: as trained)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model config allows."""
    head_dim: int | None = None
    """Per-head width (None: hidden_size / num_attention_heads)."""


SIZES = {
    "tiny": ModelSize(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        intermediate_size=256,
        vocab_size=384,
    ),
    "small": ModelSize(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        intermediate_size=768,
        vocab_size=1024,
    ),
    "0.5b": ModelSize(
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=24,
        intermediate_size=4864,
        vocab_size=1024,
        pad_vocab_to=151936,
        max_position_embeddings=32768,
    ),
    "1.5b": ModelSize(
        hidden_size=1536,
        num_attention_heads=12,
        num_key_value_heads=2,
        num_hidden_layers=28,
        intermediate_size=8960,
        vocab_size=1024,
        pad_vocab_to=151936,
        max_position_embeddings=32768,
    ),
    "0.6b": ModelSize(
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_hidden_layers=28,
        intermediate_size=3072,
        vocab_size=1024,
        pad_vocab_to=151936,
        max_position_embeddings=40960,
        head_dim=128,
    ),
}
ARCHS = ("qwen2", "qwen3", "qwen3_moe")
MOE_EXPERTS, MOE_TOP_K = 8, 2
"""Experts per MoE layer and experts per token of ``--arch qwen3_moe``."""


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .data.synthetic import tokenizer_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tokenizer_corpus(seed=seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def extend_vocab(tokenizer: Any, size: int):
    """A copy of the byte-level BPE ``tokenizer`` with synthetic merges appended until it has ``size``
    tokens."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    if size < len(vocab):
        raise ValueError(
            f"vocab_size={size} is below the {len(vocab)} tokens the tokenizer was trained to: raise it"
        )
    as_pair = (
        (lambda a, b: [a, b]) if not merges or isinstance(merges[0], list) else (lambda a, b: f"{a} {b}")
    )
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = ((a, b) for a, b in product(alphabet, alphabet))
    triples = ((a + b, c) for a, b, c in product(alphabet, alphabet, alphabet))
    for left, right in (p for gen in (pairs, triples) for p in gen):
        if len(vocab) >= size:
            break
        if left + right in vocab or left not in vocab:
            continue
        vocab[left + right] = len(vocab)
        merges.append(as_pair(left, right))
    if len(vocab) < size:
        raise ValueError(f"vocab_size={size} is more than {len(vocab)} byte pairs and triples can fill")
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=None,
        bos_token=None,
        chat_template=tokenizer.chat_template,
        model_max_length=tokenizer.model_max_length,
        clean_up_tokenization_spaces=False,
    )


def model_config(arch: str, size: str, tokenizer: Any, max_position_embeddings: int | None = None):
    """The HF config of ``arch`` at ``size`` for ``tokenizer``'s vocabulary."""
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not supported: use one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"--size {size!r} is unknown: use one of {', '.join(SIZES)}")
    s = SIZES[size]
    vocab = -(-len(tokenizer) // 64) * 64
    moe = {}
    if arch == "qwen3_moe":
        moe = dict(
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            moe_intermediate_size=s.intermediate_size // 4,
            norm_topk_prob=True,
        )
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim or s.hidden_size // s.num_attention_heads,
        max_position_embeddings=max_position_embeddings or s.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None,
        torch_dtype="float32",
        **moe,
    )


def init_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    size: str = "tiny",
    seed: int = 0,
    vocab_size: int | None = None,
) -> Path:
    """Write a random-init model, its generation config and tokenizer to ``out_dir``; return the path.

    ``vocab_size`` pads the tokenizer to exactly that many tokens (None: the size's own vocabulary)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {str(out)!r} exists and is not empty: choose a new directory")
    tokenizer = build_tokenizer(SIZES[size].vocab_size if size in SIZES else 0, seed=seed)
    target = vocab_size or (SIZES[size].pad_vocab_to if size in SIZES else None)
    if target is not None:
        tokenizer = extend_vocab(tokenizer, target)
    config = model_config(arch, size, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model_dir: str | Path) -> int:
    """Parameters of the model at ``model_dir``, counted on the meta device (nothing is loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
