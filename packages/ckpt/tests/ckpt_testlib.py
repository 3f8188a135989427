"""Shared pieces of the ckpt tests: a tiny Qwen2 model directory, deterministic training, exact
comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from posttrain.core.testing import save_tiny_model

K_STEPS, N_STEPS = 2, 4


def make_model_dir(path: Path, tie: bool = False) -> Path:
    """A tiny Qwen2 checkpoint (random init, dropout on) with a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_model(path, max_position_embeddings=64, attention_dropout=0.1, tie_word_embeddings=tie)
    vocab = {f"w{i}": i for i in range(250)} | {"<unk>": 250}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return path


class Block(torch.nn.Module):
    """Pre-norm MLP block with dropout (so resuming needs the torch RNG state)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up_proj = torch.nn.Linear(hidden, 2 * hidden)
        self.down_proj = torch.nn.Linear(2 * hidden, hidden)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down_proj(torch.nn.functional.gelu(self.up_proj(self.norm(x)))))


class TinyLM(torch.nn.Module):
    """A small causal-LM-shaped torch model (no transformers import: fast in subprocesses)."""

    def __init__(self, vocab: int = 256, hidden: int = 64, layers: int = 2, tie: bool = False) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Block(hidden) for _ in range(layers))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        if tie:  # one Parameter under two names, as with tie_word_embeddings
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self(input_ids)[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
        )


def build(
    model_dir: Path | None = None, mesh: Any | None = None, lr: float = 1e-2, tie: bool = False
) -> tuple[Any, Any, Any]:
    """Model (TinyLM, tied when ``tie``, or the HF model in ``model_dir``; FSDP2 per layer + root when
    ``mesh``), AdamW and a warm-up LambdaLR."""
    if model_dir is None:
        torch.manual_seed(0)
        model = TinyLM(tie=tie)
        layers = model.layers
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        layers = model.model.layers
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def batch(step: int, rank: int) -> torch.Tensor:
    """Token ids of ``step`` on ``rank``, independent of any global RNG."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 250, (2, 12), generator=g)


def train_step(model: Any, opt: Any, sched: Any, step: int, rank: int) -> torch.Tensor:
    """One AdamW step on ``batch(step, rank)`` (dropout draws from the torch RNG); returns the loss."""
    ids = batch(step, rank)
    loss = model.loss(ids) if isinstance(model, TinyLM) else model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().clone()


def full_state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Full (gathered) model and flattened optimizer state as CPU tensors/values (collective under FSDP)."""
    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    )
    out = {f"model.{k}": v for k, v in msd.items()}
    out.update({f"optim.{k}": v for k, v in osd.items()})
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def assert_identical(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    """Same keys, bit-identical tensors, equal plain values."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:10]}"
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k} dtype/shape differ"
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max {float((a[k] - b[k]).abs().max())})"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]!r} != {b[k]!r}"


def rng_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two ``capture_rng()`` results describe the same generator states."""
    return (
        a["python"] == b["python"]
        and torch.equal(a["torch"], b["torch"])
        and torch.equal(a["numpy"]["keys"], b["numpy"]["keys"])
        and a["numpy"]["pos"] == b["numpy"]["pos"]
    )
