"""torchtitan's Qwen3 / Llama-3 model for a Hugging Face checkpoint, and an HF-named view of its parameters.

:func:`titan_model_config` turns an HF ``config.json`` into torchtitan's model config (``Qwen3Model.Config`` or
``Llama3Model.Config``) with separate q/k/v projections and HF's rotate-half RoPE (``CosSinRoPE``), so every
torchtitan parameter is an HF tensor as stored (no fused qkv, no RoPE permutation of q/k). The output layer is
:class:`~posttrain.torchtitan.head.StatsHead`. Anything else is refused by name before any work
(:func:`check_supported`).

:func:`hf_view` puts the model's own leaf modules (the same parameter objects, plain or FSDP-sharded) under the
HF names of torchtitan's state-dict adapter (``from_hf_map``). Checkpoints (:mod:`posttrain.ckpt`), the rollout's
weight stream and the initial load all go through this view, so they see HF names and write the layout the
other engines write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from . import compat

SUPPORTED = ("qwen3", "llama")
"""HF ``model_type`` values this engine builds."""

_REFUSED = {
    "qwen3_moe": "MoE (expert parallelism) is not implemented in the torchtitan engine yet",
    "qwen2": "torchtitan 0.3.0 has no Qwen2 model (make a Qwen3 one: posttrain model init --arch qwen3)",
}


@dataclass(frozen=True)
class Family:
    """torchtitan classes of one HF model type."""

    model_cls: type
    block_cls: type
    adapter_cls: type
    qk_norm: bool


def _family(model_type: str) -> Family:
    compat.prepare_model_imports()
    if model_type == "qwen3":
        from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        return Family(Qwen3Model, Qwen3TransformerBlock, Qwen3StateDictAdapter, qk_norm=True)
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Family(Llama3Model, Llama3TransformerBlock, Llama3StateDictAdapter, qk_norm=False)


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def check_supported(hf_config: Any) -> None:
    """Raise a ValueError naming the fix unless this engine can build ``hf_config``'s model exactly."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED:
        why = _REFUSED.get(kind, "torchtitan 0.3.0 has no such model in this engine")
        raise ValueError(
            f"model_type={kind!r}: {why}. The torchtitan engine builds {', '.join(SUPPORTED)} "
            "(Qwen3, Llama-3 dense); use model_engine=fsdp2 for this model"
        )
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] != "default":
        raise ValueError(
            f"rope_type={rope['rope_type']!r}: the torchtitan engine builds RoPE without scaling only; use "
            "model_engine=fsdp2 for this model"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"{flag}=true: torchtitan's {kind} has no biases; use model_engine=fsdp2")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "use_sliding_window=true is not built by the torchtitan engine: use model_engine=fsdp2"
        )


def titan_model_config(hf_config: Any, inner_attention: Any) -> Any:
    """torchtitan model config equal to the HF model of ``hf_config`` (checked by :func:`check_supported`)."""
    from torchtitan.models.common import CosSinRoPE, Embedding
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.nn_modules import RMSNorm

    from .head import StatsHead

    check_supported(hf_config)
    fam = _family(hf_config.model_type)
    dim, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or dim // heads
    std = getattr(hf_config, "initializer_range", 0.02)
    linear = {"weight": partial(nn.init.normal_, std=std)}
    ones = {"weight": nn.init.ones_}
    eps = hf_config.rms_norm_eps

    def norm(width: int) -> Any:
        return RMSNorm.Config(normalized_shape=width, eps=eps, param_init=ones)

    rope = CosSinRoPE.Config(
        dim=head_dim,
        max_seq_len=hf_config.max_position_embeddings,
        theta=float(_rope_parameters(hf_config)["rope_theta"]),
    )
    layers = [
        fam.block_cls.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=hf_config.num_key_value_heads,
                head_dim=head_dim,
                wqkv_param_init=linear,
                wo_param_init=linear,
                inner_attention=inner_attention,
                fuse_qkv=False,
                rope=rope,
                qk_norm=norm(head_dim) if fam.qk_norm else None,
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=hf_config.intermediate_size,
                w1_param_init=linear,
                w2w3_param_init=linear,
            ),
        )
        for _ in range(hf_config.num_hidden_layers)
    ]
    vocab = hf_config.vocab_size
    config = fam.model_cls.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=linear),
        lm_head=StatsHead.Config(in_features=dim, out_features=vocab, param_init=linear),
        layers=layers,
    )
    return config


def build_model(hf_config: Any, inner_attention: Any) -> nn.Module:
    """The torchtitan model on the meta device (materialize with :func:`materialize`)."""
    with torch.device("meta"):
        return titan_model_config(hf_config, inner_attention).build()


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate on ``device``, run torchtitan's initialisers (RoPE caches; parameters seeded, then overwritten
    by the checkpoint's weights)."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_states(buffer_device=device)


def hf_name_map(model: nn.Module, model_type: str) -> dict[str, str]:
    """torchtitan module path -> HF module path, for every leaf module with parameters, from torchtitan's
    state-dict adapter (``from_hf_map``)."""
    adapter = _family(model_type).adapter_cls(model.config, None)
    to_hf = {v: k for k, v in adapter.from_hf_map.items() if v is not None}
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        name = _clean(name)
        key = re.sub(r"\.(\d+)\.", ".{}.", name, count=1)
        layer = re.search(r"\.(\d+)\.", name)
        if key not in to_hf:
            raise ValueError(f"{name}: not in torchtitan's {model_type} state-dict adapter map")
        hf = to_hf[key].format(layer.group(1)) if layer else to_hf[key]
        out[name.rsplit(".", 1)[0]] = hf.rsplit(".", 1)[0]
    return out


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


def hf_view(model: nn.Module, model_type: str) -> nn.Module:
    """A module tree holding ``model``'s leaf modules under their HF paths (shared, not copied)."""
    view = nn.Module()
    for titan_path, hf_path in hf_name_map(model, model_type).items():
        parent = view
        *heads, leaf = hf_path.split(".")
        for part in heads:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, model.get_submodule(titan_path))
    return view
