"""Helpers for the packages' tests: tiny random-init Hugging Face models and a torchrun launcher.

The library never imports this module. Importing it loads torch only: transformers, which engine-core does not
depend on, is imported inside the functions that build models, so a test venv without transformers
(engine-core's own) can still import it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

TINY_QWEN2 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
"""The tiny dense Qwen2 (about 0.1 M parameters); tests override fields (vocabulary, head_dim 64 for vLLM's
CPU attention, tied embeddings) through :func:`tiny_model`'s keyword arguments."""

TINY_QWEN3_MOE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
"""The tiny Qwen3-MoE: 4 experts, top-2, in both layers."""

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    vocab_size=151936,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    tie_word_embeddings=True,
)
"""Qwen2.5-0.5B's ``config.json`` fields that the memory policy reads (the shape, no weights): the tests of the
memory choices size the real model with it."""

QWEN25_15B = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    vocab_size=151936,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    tie_word_embeddings=True,
)
"""Qwen2.5-1.5B's, as :data:`QWEN25_05B`."""

ARCHS = {"qwen2": TINY_QWEN2, "qwen3_moe": TINY_QWEN3_MOE}


def tiny_config(arch: str = "qwen2", **overrides: Any) -> Any:
    """The transformers config of ``arch`` (a key of :data:`ARCHS`) with ``overrides`` applied."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    if arch not in ARCHS:
        raise ValueError(f"tiny_config: unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    cls = {"qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    return cls(**{**ARCHS[arch], **overrides})


def tiny_model(arch: str = "qwen2", *, seed: int = 0, value_model: bool = False, **overrides: Any) -> Any:
    """A random-init float32 model of :func:`tiny_config` (``torch.manual_seed(seed)`` first): a causal LM, or
    with ``value_model`` a one-label token classifier without dropout (a critic)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    if value_model:
        config.num_labels = 1
        config.classifier_dropout = 0.0
        return AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(path: str | Path, arch: str = "qwen2", **kwargs: Any) -> str:
    """:func:`tiny_model` (same arguments) saved as a Hugging Face directory at ``path``; returns
    ``str(path)``."""
    tiny_model(arch, **kwargs).save_pretrained(str(path))
    return str(path)


def torchrun(
    target: str | Path,
    *args: Any,
    nproc: int = 2,
    module: bool = False,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the script ``target`` (with ``module``, the module of that name) on ``nproc`` local processes with
    ``torch.distributed.run --standalone``, ``OMP_NUM_THREADS=1`` unless ``env`` says otherwise. Returns the
    finished process (output captured as text); a non-zero exit raises AssertionError with the output's
    tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [*(["-m"] if module else []), str(target), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {Path(str(target)).name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def half_greedy_sequences(model: Any, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Token sequences for ``model`` (an HF causal LM) in which each next token is, by a seeded coin flip, the
    model's argmax at the previous position or a random token: token accuracy is then well inside (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seqs = []
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, vocab, (1,), generator=gen)
            while ids.numel() < n:
                if float(torch.rand((), generator=gen)) < 0.5:
                    nxt = model(ids[None]).logits[0, -1].double().argmax().reshape(1)
                else:
                    nxt = torch.randint(0, vocab, (1,), generator=gen)
                ids = torch.cat([ids, nxt])
            seqs.append(ids)
    return seqs


def argmax_hits(model: Any, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Reference token accuracy per token of the packed ``seqs``: 1.0 where the token is the argmax of
    ``model``'s float64 logits at the previous position, 0.0 elsewhere and at each sequence's first token."""
    out = []
    with torch.no_grad():
        for ids in seqs:
            hits = torch.zeros(ids.numel(), dtype=torch.float64)
            hits[1:] = (model(ids[None]).logits[0, :-1].double().argmax(-1) == ids[1:]).double()
            out.append(hits)
    return torch.cat(out)
