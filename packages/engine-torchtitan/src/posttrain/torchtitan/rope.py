"""HF's rotate-half RoPE with Llama-3.1 frequency scaling, on torchtitan's ``CosSinRoPE``.

torchtitan 0.3.0 has Llama-3 scaling only in its complex (interleaved) RoPE, whose q/k layout is not HF's
stored one; its ``CosSinRoPE`` refuses ``scaling="llama"``. :class:`LlamaScaledCosSinRoPE` is ``CosSinRoPE``
with that branch: the same ``RoPE.Config`` fields (``scaling_factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``) and the formula of HF's
``_compute_llama3_parameters``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.models.common import CosSinRoPE


def llama3_inv_freq(cfg: Any) -> torch.Tensor:
    """Inverse frequencies of a ``RoPE.Config`` with ``scaling="llama"`` (fp32)."""
    dim = cfg.dim
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    low_wavelen = cfg.original_max_position_embeddings / cfg.low_freq_factor
    high_wavelen = cfg.original_max_position_embeddings / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.scaling_factor, inv_freq)
    smooth = (cfg.original_max_position_embeddings / wavelen - cfg.low_freq_factor) / (
        cfg.high_freq_factor - cfg.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.scaling_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class LlamaScaledCosSinRoPE(CosSinRoPE):
    """``CosSinRoPE`` whose cache uses Llama-3 scaled frequencies (``config.scaling == "llama"``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        cfg = self.config
        if cfg.scaling != "llama":
            raise ValueError(f"LlamaScaledCosSinRoPE needs scaling='llama', got {cfg.scaling!r}")
        inv_freq = llama3_inv_freq(cfg)
        t = torch.arange(cfg.max_seq_len, dtype=inv_freq.dtype, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq).float()
        theta = torch.cat([freqs, freqs], dim=-1)
        return torch.cat([theta.cos(), theta.sin()], dim=-1)
