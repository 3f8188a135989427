"""Qwen3-MoE on torchtitan's MoE: block configs from an HF ``qwen3_moe`` config, experts, and HF expert names.

A layer ``i`` is sparse as in HF's ``Qwen3MoeDecoderLayer`` (``i`` not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``): torchtitan's ``MoE`` with a softmax top-k router (``route_norm`` =
``norm_topk_prob``), no shared experts and no load-balancing expert bias (HF's model has none, and an
aux-loss-free bias would route differently from the checkpoint's model). The routing weights multiply the
expert outputs, as in HF.

Experts. torchtitan's ``GroupedExperts`` casts tokens and weights to bfloat16 for ``torch._grouped_mm``; the
engine uses it only on CUDA computing in bfloat16 (:func:`experts_config`). Elsewhere :class:`LoopedExperts`
(the same parameters under the same names) runs each expert's SwiGLU with ``F.linear`` in the dtype the tokens
arrive in, so an fp32 engine is fp32 throughout.

Names. torchtitan keeps one ``(experts, ...)`` tensor per projection (``w1_EFD`` gate, ``w3_EFD`` up,
``w2_EDF`` down); HF safetensors hold one tensor per expert (``mlp.experts.<e>.{gate,up,down}_proj.weight``).
:func:`group_experts` stacks the latter into the former (loading), :func:`split_experts` splits them back (the
rollout's weight stream).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.moe import GroupedExperts

logger = logging.getLogger(__name__)

EXPERT_PARAMS = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}
"""torchtitan's grouped expert parameter -> HF's per-expert projection."""

_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_moe(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == "qwen3_moe"


def num_experts(hf_config: Any) -> int:
    """Routed experts per sparse layer: ``num_experts`` (the Qwen3-MoE release configs) or
    ``num_local_experts`` (what transformers 5 writes)."""
    n = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not n:
        raise ValueError(
            f"{hf_config.model_type} config without num_experts / num_local_experts: is it a complete "
            "Qwen3-MoE config.json?"
        )
    return int(n)


def sparse_layers(hf_config: Any) -> set[int]:
    """Indices of the layers that are MoE in HF's Qwen3-MoE."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return {i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0}


class LoopedExperts(GroupedExperts):
    """torchtitan's grouped experts computed one expert at a time with ``F.linear`` in the tokens' dtype (the
    rows arrive sorted by expert, ``num_tokens_per_expert_E`` rows each)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (
            w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        counts = [int(n) for n in num_tokens_per_expert_E.tolist()]
        rest = x_RD.shape[0] - sum(counts)
        outs = []
        for e, rows in enumerate(torch.split(x_RD, [*counts, rest])[: len(counts)]):
            hidden = F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e])
            outs.append(F.linear(hidden, w2[e]))
        outs.append(x_RD.new_zeros(rest, w2.shape[1]))
        return torch.cat(outs)


@dataclass(frozen=True)
class ExpertsPlan:
    """How the experts of a MoE model are built: their config class and the expert-parallel degree."""

    config_cls: type
    ep_size: int = 1


def check_expert_parallel(hf_config: Any, ep_size: int) -> None:
    """Raise a ValueError naming the fix unless ``ep_size`` is 1 or divides a MoE model's experts."""
    if ep_size == 1:
        return
    if not is_moe(hf_config):
        raise ValueError(
            f"engine.ep_size={ep_size} on the dense model {hf_config.model_type}: expert parallelism splits "
            "MoE experts; set engine.ep_size=1"
        )
    n = num_experts(hf_config)
    if n % ep_size:
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"engine.ep_size={ep_size} does not divide the model's {n} experts: use one of {fits}"
        )


def experts_config(device: torch.device, dtype: torch.dtype, ep_size: int = 1) -> ExpertsPlan:
    """torchtitan's ``GroupedExperts.Config`` on CUDA computing in bfloat16, else :class:`LoopedExperts`'
    (logged); with ``ep_size``."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        return ExpertsPlan(GroupedExperts.Config, ep_size)
    logger.info(
        "torchtitan engine on %s in %s: MoE experts run one F.linear per expert in that dtype (torchtitan's "
        "grouped experts compute in bfloat16)",
        device.type,
        dtype,
    )
    return ExpertsPlan(LoopedExperts.Config, ep_size)


def moe_config(hf_config: Any, plan: ExpertsPlan, linear: dict) -> Any:
    """torchtitan's ``MoE.Config`` of one HF Qwen3-MoE sparse block; with ``ep_size > 1`` its all-to-all token
    dispatcher (the EP mesh is wired by ``model.parallelize``)."""
    from torchtitan.models.common.config_utils import make_moe_config, make_router_config
    from torchtitan.models.common.moe import RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    dim, n, k = hf_config.hidden_size, num_experts(hf_config), hf_config.num_experts_per_tok
    init = {name: partial(nn.init.normal_, std=linear["weight"].keywords["std"]) for name in EXPERT_PARAMS}
    routed = RoutedExperts.Config(
        inner_experts=plan.config_cls(
            dim=dim, hidden_dim=hf_config.moe_intermediate_size, num_experts=n, param_init=init
        ),
        token_dispatcher=(AllToAllTokenDispatcher if plan.ep_size > 1 else LocalTokenDispatcher).Config(
            num_experts=n, top_k=k
        ),
    )
    router = make_router_config(
        dim=dim,
        num_experts=n,
        gate_param_init=linear,
        top_k=k,
        score_func="softmax",
        route_norm=bool(getattr(hf_config, "norm_topk_prob", False)),
    )
    return make_moe_config(num_experts=n, router=router, routed_experts=routed, load_balance_coeff=None)


def group_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF per-expert tensors stacked into ``<layer>.mlp.experts.{w1_EFD,w3_EFD,w2_EDF}``; the rest
    unchanged."""
    out: dict[str, torch.Tensor] = {}
    found: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        m = _HF_EXPERT.match(name)
        if m is None:
            out[name] = tensor
        else:
            found.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor
    titan = {hf: t for t, hf in EXPERT_PARAMS.items()}
    for (prefix, proj), by_expert in found.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(
                f"{prefix}: experts {sorted(by_expert)} are not 0..n-1: an incomplete checkpoint?"
            )
        out[f"{prefix}.{titan[proj]}"] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def split_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as HF names it: a grouped expert tensor becomes one tensor per expert."""
    prefix, _, param = name.rpartition(".")
    if param not in EXPERT_PARAMS or not prefix.endswith(".mlp.experts"):
        yield name, tensor
        return
    for e in range(tensor.shape[0]):
        yield f"{prefix}.{e}.{EXPERT_PARAMS[param]}.weight", tensor[e]
