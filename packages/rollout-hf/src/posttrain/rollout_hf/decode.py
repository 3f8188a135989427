"""The HF rollout's decode loop: one batched generation over a transformers causal LM, kept on the device.

The prompts are left-padded into one ``(rows, width)`` batch, prefilled once, then decoded one token per step.
Every row stays in the batch until the end: a row that produced a stop token is masked (it is fed the pad
token and its later outputs are dropped), so shapes never change and nothing per token needs the host:

- the KV cache is transformers' ``StaticCache`` sized ``width + max_new_tokens`` (``rollout.cache``;
  ``dynamic`` uses the ``DynamicCache`` that grows by one slot a step);
- the attention masks are built here as 4-D tensors (sdpa's boolean or eager's additive form) from the prompt
  mask and the step's cache slot, so HF's mask code, which reads mask values on the host, is skipped; models
  with sliding-window layers or another attention implementation get the 2-D mask and HF's own masks; a masked
  one-token step attends without copying the cache per query head (:mod:`posttrain.rollout_hf.attention`);
- sampling, log-probs (:mod:`posttrain.rollout_hf.sampling`), the stop test and the finished mask are device
  ops; whether every row has finished is read only every ``stop_check_interval`` steps.

With ``rollout.compile`` the one-token forward is ``torch.compile``'d (CUDA graphs with the default
mode); prompts are then padded to the rollout's prompt budget so every call has the same shapes, and the
static cache is kept between calls (until ``sleep``) so the compiled graph is reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core import SamplingConfig

from .attention import ATTN_IMPLEMENTATION
from .config import HFRolloutConfig
from .routing import RoutingRecorder
from .sampling import select_tokens


@dataclass
class Decoded:
    """What one generation produced, on the CPU."""

    tokens: torch.Tensor
    """(rows, max_new_tokens) token ids; pad after a row's end."""
    log_probs: torch.Tensor
    """(rows, max_new_tokens) float32 log-probs of the sampled tokens; 0 after a row's end."""
    lengths: list[int]
    """Response length of each row (its stop token included)."""
    stopped: list[bool]
    """True for a row that ended on a stop token, False for one that hit ``max_new_tokens``."""


def prepared_masks_supported(model: torch.nn.Module) -> bool:
    """True when every layer attends over the full cache with sdpa or eager attention (our 4-D masks fit)."""
    config = model.config
    text = config.get_text_config(decoder=True)
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    full = layer_types == {"full_attention"} and getattr(text, "sliding_window", None) is None
    return full and getattr(config, "_attn_implementation", None) in ("sdpa", ATTN_IMPLEMENTATION, "eager")


class StepMasks:
    """Attention masks of one generation: a query at cache slot ``s`` sees the real prompt tokens and the
    response slots up to ``s``; a pad query of the prefill sees only itself (no fully masked row)."""

    def __init__(
        self, prompt_mask: torch.Tensor, max_new: int, static: bool, prepared: bool, dtype: torch.dtype
    ):
        self.width = prompt_mask.shape[1]
        self.static, self.prepared, self.dtype = static, prepared, dtype
        self.keys = torch.cat([prompt_mask, prompt_mask.new_ones((prompt_mask.shape[0], max_new))], dim=1)
        self.slots = torch.arange(self.keys.shape[1], device=prompt_mask.device)

    def _kv(self, last_slot: int) -> int:
        return self.keys.shape[1] if self.static else last_slot + 1

    def _finish(self, allowed: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.bool:
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min
        )

    def prefill(self) -> torch.Tensor:
        kv = self._kv(self.width - 1)
        if not self.prepared:
            return self.keys[:, : self.width].long()
        query = self.slots[: self.width, None]
        keys = self.slots[None, :kv]
        allowed = (self.keys[:, None, None, :kv] & (keys <= query)) | (keys == query)
        return self._finish(allowed)

    def step(self, slot: int) -> torch.Tensor:
        kv = self._kv(slot)
        if not self.prepared:
            return self.keys[:, : slot + 1].long()
        return self._finish(self.keys[:, None, None, :kv] & (self.slots[:kv] <= slot))


def left_pad(
    rows: list[list[int]], width: int, pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, bool mask), both (rows, width), each prompt right-aligned."""
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids.to(device), mask.to(device)


class Decoder:
    """Runs generations; with ``compile`` it keeps the compiled step and its static cache between calls."""

    def __init__(self, config: HFRolloutConfig, pad_token_id: int) -> None:
        self.options, self.pad = config, pad_token_id
        self._step_fn: Any = None
        self._cache: Any = None
        self._cache_shape: tuple[int, int] | None = None

    def reset(self) -> None:
        """Drop the kept cache and compiled step (before the weights move, or to free memory)."""
        self._step_fn, self._cache, self._cache_shape = None, None, None

    def _new_cache(self, model: torch.nn.Module, rows: int, slots: int) -> Any:
        from transformers import DynamicCache, StaticCache

        if self.options.cache == "dynamic":
            return DynamicCache(config=model.config)
        if self.options.compile and self._cache_shape == (rows, slots):
            self._cache.reset()
            return self._cache
        cache = StaticCache(config=model.config, max_cache_len=slots)
        if self.options.compile:
            self._cache, self._cache_shape = cache, (rows, slots)
        return cache

    def _step(self, model: torch.nn.Module) -> Any:
        if not self.options.compile:
            return model
        if self._step_fn is None:
            self._step_fn = torch.compile(model, mode=self.options.compile_mode, dynamic=False)
        return self._step_fn

    def _forward(
        self, fn: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        out = fn(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def run(
        self,
        model: torch.nn.Module,
        rows: list[list[int]],
        sampling: SamplingConfig,
        generator: torch.Generator,
        stop_ids: list[int],
        routing: RoutingRecorder | None = None,
        width: int | None = None,
    ) -> Decoded:
        """Generate for every row (left-padded to ``width``, default the longest); see the module
        docstring."""
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        num, max_new = len(rows), sampling.max_new_tokens
        ids, prompt_mask = left_pad(rows, width or max(len(r) for r in rows), self.pad, device)
        width = ids.shape[1]
        prepared = prepared_masks_supported(model)
        mask_dtype = dtype if model.config._attn_implementation == "eager" else torch.bool
        masks = StepMasks(prompt_mask, max_new, self.options.cache == "static", prepared, mask_dtype)
        cache = self._new_cache(model, num, width + max_new)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
        tokens = torch.full((num, max_new), self.pad, dtype=torch.long, device=device)
        log_probs = torch.zeros((num, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((num,), max_new, dtype=torch.long, device=device)
        stopped = torch.zeros(num, dtype=torch.bool, device=device)
        prompt_lens = prompt_mask.sum(-1)
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(model, ids, masks.prefill(), positions, cache)
        if routing is not None:
            routing.record(0, (num, width))
        step_fn = self._step(model)
        for t in range(max_new):
            if t > 0:
                pos = (prompt_lens + (t - 1)).unsqueeze(-1)
                logits = self._forward(step_fn, tokens[:, t - 1 : t], masks.step(width + t - 1), pos, cache)
                if routing is not None:
                    routing.record(t, (num, 1))
            token, logp = select_tokens(logits, sampling, generator)
            tokens[:, t] = token.masked_fill(stopped, self.pad)
            log_probs[:, t] = logp.masked_fill(stopped, 0.0)
            hit = (tokens[:, t, None] == stops).any(-1) & ~stopped
            lengths.masked_fill_(hit, t + 1)
            stopped |= hit
            if (t + 1) % self.options.stop_check_interval == 0 and bool(stopped.all()):
                break
        return Decoded(tokens.cpu(), log_probs.cpu(), lengths.tolist(), stopped.tolist())
