"""Memory-for-speed trades chosen from the model's size and the free device memory, where the user left them
unset.

A config value of ``None`` (``null`` in YAML or on the command line) means "choose"; an explicit value is
always taken as given. Each choice comes with the reason, in bytes, which the caller logs:

- :func:`choose_gradient_checkpointing`: recompute activations only when one micro-batch's saved activations
  (``max_token_len_per_gpu`` tokens) would not fit beside the training state in the free memory;
  :func:`resolve_gradient_checkpointing` applies it to a null ``model.enable_gradient_checkpointing`` for an
  engine.
  What else holds the device through the update comes off first (``beside``): a rollout that generates on
  it while the actor trains (one_step_off, async, stream; :func:`rollout_reserve_bytes`), a critic's state.
- :func:`choose_token_budget`: where the default micro-batch token budget would need recomputation, the
  largest half, quarter, ... of it (down to :data:`MIN_TOKEN_BUDGET` or the longest sequence) that does not.
- :func:`choose_ref_offload`: keep the reference model on the device unless, with it there, the rollout's
  share of the memory left could not hold its weights and the KV cache of one generate call.
- :func:`choose_max_num_seqs`: let vLLM schedule every sequence of one generate call at once (at most 1024).

The byte counts are estimates for a dense decoder (Qwen2/Llama layout) in bf16 with an fp32 master copy and
Adam:
per token and layer the saved activations of attention and a gated MLP
(``2 * (10 * hidden + 4 * intermediate)`` bytes), one fp32 row of logits per token, and 16 bytes of training
state per parameter, sharded over the ranks.
They aim to be within a factor of two, with :data:`HEADROOM` of the free memory kept back for what they miss.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import EngineConfig, ModelConfig

HEADROOM = 0.8
"""Share of the free memory a choice may plan to use; the rest absorbs the estimates' error and
fragmentation."""
MAX_SEQS = 1024
"""The most sequences :func:`choose_max_num_seqs` lets vLLM run at once."""
MIN_TOKEN_BUDGET = 8192
"""The smallest micro-batch token budget :func:`choose_token_budget` takes to avoid recomputation. Measured on
an H100 for the 1.5B shape (bench/train_throughput.py, an optimizer step per micro-batch): 8,192 tokens without
recomputation ran at 0.98-1.04x the tokens/s of 16,384 with it, 4,096 without at 0.40-0.64x."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a dense decoder that the estimates need (from its Hugging Face ``config.json``)."""

    params: int
    """Parameter count."""
    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    intermediate: int
    """MLP inner size."""
    vocab: int
    """Vocabulary size."""
    kv_bytes_per_token: int
    """KV-cache bytes per token in bf16 (keys and values of every layer)."""

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        """The shape of a ``config.json``'s dense decoder (text config of a multimodal one)."""
        c = config.get("text_config", config)
        hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        inter = c.get("intermediate_size") or 4 * hidden
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        embed = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
        params = embed + layers * (attn + 3 * hidden * inter + 2 * hidden)
        return cls(
            params=params,
            layers=layers,
            hidden=hidden,
            intermediate=inter,
            vocab=vocab,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelShape:
        """The shape of the model directory ``path`` (its ``config.json``)."""
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def train_state_bytes(self, world: int) -> int:
        """fp32 master weights, fp32 gradients and Adam's two moments, sharded over ``world`` ranks."""
        return 16 * self.params // max(world, 1)

    def activation_bytes(self, tokens: int, checkpointing: bool) -> int:
        """Saved activations of one micro-batch of ``tokens`` tokens plus its fp32 logits; with checkpointing
        each layer keeps its input and one layer's activations live at a time."""
        per_layer = 2 * (10 * self.hidden + 4 * self.intermediate) * tokens
        kept = (
            (self.layers * 2 * self.hidden * tokens + per_layer) if checkpointing else self.layers * per_layer
        )
        return kept + 4 * self.vocab * tokens


@dataclass(frozen=True)
class Choice:
    """A chosen value and why."""

    value: object
    reason: str

    def line(self, key: str) -> str:
        """``key=value (reason)``, for the run's log."""
        return f"{key}={self.value} (chosen: {self.reason})"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def choose_gradient_checkpointing(
    shape: ModelShape, tokens: int, free_bytes: int, world: int = 1, beside: int = 0
) -> Choice:
    """Off when the training state and one ``tokens``-token micro-batch's activations without recomputation
    fit in :data:`HEADROOM` of ``free_bytes`` less ``beside`` (what else the device holds through the update:
    a rollout that generates meanwhile, :func:`rollout_reserve_bytes`; the reference; another trained role's
    state); on otherwise."""
    state = shape.train_state_bytes(world)
    need = state + shape.activation_bytes(tokens, checkpointing=False)
    budget = int(HEADROOM * max(free_bytes - beside, 0))
    free = f"{_gib(free_bytes)} free" + (f" less {_gib(beside)} held beside the update" if beside else "")
    if need <= budget:
        return Choice(
            False,
            f"state {_gib(state)} + activations of {tokens} tokens = {_gib(need)} fit in "
            f"{_gib(budget)} ({HEADROOM:.0%} of {free})",
        )
    return Choice(
        True,
        f"state + activations of {tokens} tokens = {_gib(need)} exceed {_gib(budget)} "
        f"({HEADROOM:.0%} of {free})",
    )


def choose_token_budget(
    shape: ModelShape, default: int, longest: int, free_bytes: int, world: int = 1, beside: int = 0
) -> Choice:
    """A micro-batch token budget: ``default`` when its activations fit without recomputation
    (:func:`choose_gradient_checkpointing`), else the largest of ``default / 2``, ``default / 4``, ... that fits,
    not below the run's ``longest`` sequence or :data:`MIN_TOKEN_BUDGET`; ``default`` when none fits (then
    with recomputation). Smaller micro-batches cost more steps of smaller matmuls; recomputation costs a
    second forward of every layer, about a third more compute."""
    floor = max(longest, MIN_TOKEN_BUDGET)
    tokens = default
    while (
        tokens // 2 >= floor and choose_gradient_checkpointing(shape, tokens, free_bytes, world, beside).value
    ):
        tokens //= 2
    fit = choose_gradient_checkpointing(shape, tokens, free_bytes, world, beside)
    if fit.value:
        return Choice(default, f"no budget from {default} down to {floor} tokens fits without recomputation")
    if tokens == default:
        return Choice(default, "the default fits without recomputation")
    return Choice(tokens, f"{default} tokens would need recomputation; {fit.reason}")


def rollout_reserve_bytes(
    shape: ModelShape,
    free_bytes: int,
    world: int,
    rollout_share: float,
    *,
    ref_on_device: bool,
    gib: float = 0,
) -> int:
    """What a vLLM rollout on the trainer's GPU holds while the actor trains, ``free_bytes`` being free before
    the trainer's engines are built: ``gib`` GiB when set, else ``rollout_share`` of what the engines leave
    (the actor's fp32 weights and, unless offloaded, the bf16 reference; Adam's state comes at the first step,
    after the rollout took its share). vLLM's CUDA graphs and context come on top (~2.5 GiB for the 0.5B
    shape on an H100), inside :data:`HEADROOM`."""
    if gib:
        return int(gib * 2**30)
    held = (4 + (2 if ref_on_device else 0)) * shape.params // max(world, 1)
    return int(rollout_share * max(free_bytes - held, 0))


def choose_ref_offload(
    shape: ModelShape, free_bytes: int, world: int, rollout_share: float, rollout_tokens: int
) -> Choice:
    """Keep the bf16 reference on the device (False) when, with it and the actor's training state there, the
    rollout's share (``rollout_share`` of the memory left) still holds the rollout's bf16 weights and the KV
    cache of ``rollout_tokens`` tokens (one generate call's prompts and responses) with room to spare."""
    ref = 2 * shape.params // max(world, 1)
    left = free_bytes - shape.train_state_bytes(world) - ref
    need = 2 * shape.params + shape.kv_bytes_per_token * rollout_tokens
    share = int(rollout_share * max(left, 0))
    if need <= HEADROOM * share:
        return Choice(
            False,
            f"with the reference ({_gib(ref)}) on the device the rollout's {_gib(share)} "
            f"hold its weights and the KV cache of {rollout_tokens} tokens ({_gib(need)})",
        )
    return Choice(
        True,
        f"with the reference ({_gib(ref)}) on the device the rollout's {_gib(share)} would "
        f"not hold its weights and the KV cache of {rollout_tokens} tokens ({_gib(need)})",
    )


def choose_max_num_seqs(sequences: int) -> Choice:
    """Every sequence of one generate call (``sequences``: prompts per rank x responses per prompt) at once,
    rounded up to a multiple of 16 (vLLM's CUDA-graph batch sizes step by 16 above 256), at most
    :data:`MAX_SEQS`."""
    if sequences < 1:
        raise ValueError(f"sequences={sequences}: a generate call brings at least one sequence")
    value = min(-(-sequences // 16) * 16, MAX_SEQS)
    why = "all at once" if value >= sequences else f"capped at {MAX_SEQS}"
    return Choice(value, f"one generate call brings {sequences} sequences per rank: {why}")


def resolve_gradient_checkpointing(
    model_config: ModelConfig, engine_config: EngineConfig, device: torch.device, world: int
) -> ModelConfig:
    """``model_config`` with ``enable_gradient_checkpointing`` chosen where it is null
    (:func:`choose_gradient_checkpointing` on ``device``'s free memory and one micro-batch's token budget, the
    training state sharded over ``world`` ranks), the choice printed once per process; an explicit value is
    returned as is."""
    if model_config.enable_gradient_checkpointing is not None:
        return model_config
    tokens = engine_config.max_token_len_per_gpu if engine_config.use_dynamic_bsz else None
    if engine_config.forward_only:
        choice = Choice(False, "a forward-only engine keeps no activations for a backward")
    elif device.type != "cuda":
        choice = Choice(False, f"on {device.type} activations live in host memory")
    elif tokens is None:
        choice = Choice(
            True, "no micro-batch token budget (use_dynamic_bsz=false), so no activation estimate"
        )
    else:
        import torch

        free = torch.cuda.mem_get_info(device)[0]
        choice = choose_gradient_checkpointing(ModelShape.from_path(model_config.path), tokens, free, world)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[posttrain] {choice.line('model.enable_gradient_checkpointing')}", file=sys.stderr)
    return dataclasses.replace(model_config, enable_gradient_checkpointing=bool(choice.value))
