"""HF's RMSNorm computed by one fused kernel, swapped in when the engine builds a model type it knows.

The RMSNorm of Llama, Mistral, Qwen2 and Qwen3 (and their MoE variants) in transformers is
``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)``: eight elementwise or reduction
kernels forward, about sixteen backward, most of them reading or writing the whole tensor in fp32. A Qwen3
decoder layer runs four of them (two on the hidden state, ``q_norm`` and ``k_norm`` on the
heads). :class:`FusedRMSNorm` computes ``weight * F.rms_norm(x)``: ``F.rms_norm`` without a weight normalises
in fp32 and rounds to the input dtype, as HF's does, in one kernel each way on CUDA (``_fused_rms_norm``); the
weight is multiplied afterwards, so the result is rounded where HF rounds it (bitwise HF's on a CPU, where
``F.rms_norm`` runs HF's ops; on CUDA the fused kernel's fp32 sum may differ from HF's in its last bits).

:func:`fuse_rms_norms` swaps the modules in place (same weight parameter, same name) for the model types of
:data:`FUSED_RMS_NORM_CLASSES`; other model types are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FUSED_RMS_NORM_CLASSES: dict[str, str] = {
    "llama": "LlamaRMSNorm",
    "mistral": "MistralRMSNorm",
    "qwen2": "Qwen2RMSNorm",
    "qwen2_moe": "Qwen2MoeRMSNorm",
    "qwen3": "Qwen3RMSNorm",
    "qwen3_moe": "Qwen3MoeRMSNorm",
}
"""HF ``model_type`` -> the RMSNorm class whose forward :class:`FusedRMSNorm` reproduces (tested per
class)."""


class FusedRMSNorm(torch.nn.Module):
    """``weight * F.rms_norm(x, eps)``: HF's Llama-style RMSNorm (see the module docstring), same
    ``weight``."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)  # a no-op unless autocast changed the dtype

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def fuse_rms_norms(model: torch.nn.Module, model_type: str) -> int:
    """Replace every RMSNorm of ``model_type``'s class (:data:`FUSED_RMS_NORM_CLASSES`) in ``model`` by a
    :class:`FusedRMSNorm` holding the same weight; returns how many (0 for a model type not in the table)."""
    cls_name = FUSED_RMS_NORM_CLASSES.get(model_type)
    if cls_name is None:
        return 0
    targets = [name for name, m in model.named_modules() if type(m).__name__ == cls_name]
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        setattr(parent, attr, FusedRMSNorm(old.weight, old.variance_epsilon))
    return len(targets)
