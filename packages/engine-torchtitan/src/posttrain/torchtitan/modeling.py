"""torchtitan's Qwen3 / Llama-3 model for a Hugging Face checkpoint, and an HF-named view of its parameters.

:func:`titan_model_config` turns an HF ``config.json`` into torchtitan's model config (``Qwen3Model.Config``
or ``Llama3Model.Config``) with separate q/k/v projections and HF's rotate-half RoPE (``CosSinRoPE``), so
every torchtitan parameter is an HF tensor as stored (no fused qkv, no RoPE permutation of q/k). The output
layer is
:class:`~posttrain.torchtitan.head.StatsHead`. Anything else is refused by name before any work
(:func:`check_supported`).

:func:`hf_view` puts the model's own leaf modules (the same parameter objects, plain or FSDP-sharded) under
the HF names of torchtitan's state-dict adapter (``from_hf_map``). Checkpoints (:mod:`posttrain.ckpt`), the
rollout's weight stream and the initial load all go through this view, so they see HF names and write the
layout the other engines write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from . import compat, moe

SUPPORTED = ("qwen3", "qwen3_moe", "llama")
"""HF ``model_type`` values this engine builds."""

_REFUSED = {
    "qwen2": "torchtitan 0.3.0 has no Qwen2 model (make a Qwen3 one: posttrain model init --arch qwen3)",
}


@dataclass(frozen=True)
class Family:
    """torchtitan classes of one HF model type."""

    model_cls: type
    block_cls: type
    adapter_cls: type
    qk_norm: bool
    set_sharding: Any
    """torchtitan's ``set_<model>_sharding_config(config, enable_sp=...)`` (TP placements of every module)."""


def _family(model_type: str) -> Family:
    compat.prepare_model_imports()
    if model_type in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        sharding = partial(set_qwen3_sharding_config, enable_ep=False)
        return Family(Qwen3Model, Qwen3TransformerBlock, Qwen3StateDictAdapter, True, sharding)
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Family(
        Llama3Model, Llama3TransformerBlock, Llama3StateDictAdapter, False, set_llama3_sharding_config
    )


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
            "(Qwen3, Qwen3-MoE, Llama-3); use model_engine=fsdp2 for this model"
        )
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ValueError(
            f"rope_type={rope['rope_type']!r}: the torchtitan engine builds RoPE without scaling or with "
            "Llama-3 scaling (rope_type llama3) only; use model_engine=fsdp2 for this model"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"{flag}=true: torchtitan's {kind} has no biases; use model_engine=fsdp2")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "use_sliding_window=true is not built by the torchtitan engine: use model_engine=fsdp2"
        )


def check_tensor_parallel(hf_config: Any, tp_size: int) -> None:
    """Raise a ValueError naming the fix unless ``tp_size`` divides the query and key/value heads (and is 1
    for an MoE model)."""
    if tp_size > 1 and moe.is_moe(hf_config):
        raise ValueError(
            f"engine.tp_size={tp_size} with the MoE model {hf_config.model_type}: the torchtitan engine runs "
            "MoE models without tensor parallelism; set engine.tp_size=1 (FSDP2 over all ranks)"
        )
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if tp_size > 1 and (heads % tp_size or kv % tp_size):
        fits = [d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]
        raise ValueError(
            f"engine.tp_size={tp_size} does not divide the model's {heads} attention heads and {kv} "
            f"key/value heads: use a tp_size in {fits}"
        )


def _rope_config(hf_config: Any, head_dim: int) -> Any:
    """torchtitan's ``CosSinRoPE.Config`` (HF's rotate-half layout); with ``rope_type: llama3`` the Llama-3.1
    scaling parameters go into its ``scaling_*`` fields and :class:`LlamaScaledCosSinRoPE` builds the
    cache."""
    from torchtitan.models.common import CosSinRoPE

    from .rope import LlamaScaledCosSinRoPE

    params = _rope_parameters(hf_config)
    common = dict(
        dim=head_dim, max_seq_len=hf_config.max_position_embeddings, theta=float(params["rope_theta"])
    )
    if params["rope_type"] != "llama3":
        return CosSinRoPE.Config(**common)
    return LlamaScaledCosSinRoPE.Config(
        **common,
        scaling="llama",
        scaling_factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _block_configs(
    hf_config: Any, fam: Family, inner_attention: Any, norm: Any, linear: dict, experts: Any
) -> list[Any]:
    """One torchtitan decoder block config per HF layer: GQA attention (separate q/k/v, RoPE, Qwen3's qk-norm)
    and the SwiGLU feed-forward, or on a Qwen3-MoE sparse layer torchtitan's MoE (:mod:`.moe`) with
    ``experts`` (a :class:`~posttrain.torchtitan.moe.ExpertsPlan`; default torchtitan's grouped experts)."""
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    dim, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or dim // heads
    rope = _rope_config(hf_config, head_dim)
    sparse = moe.sparse_layers(hf_config) if moe.is_moe(hf_config) else set()
    experts = experts or moe.ExpertsPlan(moe.GroupedExperts.Config)
    return [
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
            feed_forward=None
            if i in sparse
            else make_ffn_config(
                dim=dim,
                hidden_dim=hf_config.intermediate_size,
                w1_param_init=linear,
                w2w3_param_init=linear,
            ),
            moe=moe.moe_config(hf_config, experts, linear) if i in sparse else None,
        )
        for i in range(hf_config.num_hidden_layers)
    ]


def titan_model_config(
    hf_config: Any,
    inner_attention: Any,
    tp_size: int = 1,
    value_head: bool = False,
    experts: Any = None,
) -> Any:
    """torchtitan model config equal to the HF model of ``hf_config`` (checked by :func:`check_supported`);
    with ``tp_size > 1`` every module carries torchtitan's TP placements (no sequence parallelism: the packed
    attention needs whole rows), the output layer :func:`~posttrain.torchtitan.head.tp_sharding_config`. With
    ``value_head`` the output layer is a ``hidden -> 1`` linear with a bias (HF's token-classification
    ``score``), untied. ``experts``: how a MoE model's experts are built
    (:func:`posttrain.torchtitan.moe.experts_config`); with its ``ep_size > 1`` the MoE modules carry
    torchtitan's expert-parallel placements."""
    from torchtitan.models.common import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.nn_modules import RMSNorm

    from .head import StatsHead

    check_supported(hf_config)
    fam = _family(hf_config.model_type)
    dim, vocab = hf_config.hidden_size, hf_config.vocab_size
    std = getattr(hf_config, "initializer_range", 0.02)
    linear = {"weight": partial(nn.init.normal_, std=std)}

    def norm(width: int) -> Any:
        return RMSNorm.Config(
            normalized_shape=width, eps=hf_config.rms_norm_eps, param_init={"weight": nn.init.ones_}
        )

    if value_head:
        zeros = {"weight": partial(nn.init.normal_, std=std), "bias": nn.init.zeros_}
        head = Linear.Config(in_features=dim, out_features=1, bias=True, param_init=zeros)
    else:
        head = StatsHead.Config(in_features=dim, out_features=vocab, param_init=linear)
    config = fam.model_cls.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=linear),
        lm_head=head,
        layers=_block_configs(hf_config, fam, inner_attention, norm, linear, experts),
    )
    if experts is not None and experts.ep_size > 1:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        moe.check_expert_parallel(hf_config, experts.ep_size)
        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    if tp_size > 1:
        from .head import tp_sharding_config

        check_tensor_parallel(hf_config, tp_size)
        fam.set_sharding(config, enable_sp=False)
        config.lm_head.sharding_config = tp_sharding_config()
    return config


def build_model(
    hf_config: Any,
    inner_attention: Any,
    tp_size: int = 1,
    value_head: bool = False,
    experts: Any = None,
) -> nn.Module:
    """The torchtitan model on the meta device (materialize with :func:`materialize`)."""
    with torch.device("meta"):
        return titan_model_config(hf_config, inner_attention, tp_size, value_head, experts).build()


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate on ``device``, run torchtitan's initialisers (RoPE caches; parameters seeded, then overwritten
    by the checkpoint's weights)."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_states(buffer_device=device)


VALUE_HEAD = "score"
"""HF name of the value head (``*ForTokenClassification.score``), torchtitan's ``lm_head`` in a value
model."""


def hf_name_map(model: nn.Module, model_type: str) -> dict[str, str]:
    """torchtitan module path -> HF module path, for every leaf module with parameters, from torchtitan's
    state-dict adapter (``from_hf_map``); a value head (``lm_head`` of one output) is HF's ``score``."""
    value_head = model.lm_head.out_features == 1
    adapter = _family(model_type).adapter_cls(model.config, None)
    to_hf = {v: k for k, v in adapter.from_hf_map.items() if v is not None}
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        name = _clean(name)
        if value_head and name.startswith("lm_head."):
            out["lm_head"] = VALUE_HEAD
            continue
        key = re.sub(r"\.(\d+)\.", ".{}.", name, count=1)
        layer = re.search(r"\.(\d+)\.", name)
        if key not in to_hf:
            raise ValueError(f"{name}: not in torchtitan's {model_type} state-dict adapter map")
        if name.rsplit(".", 1)[-1] in moe.EXPERT_PARAMS:  # grouped experts: the module is HF's mlp.experts
            out[name.rsplit(".", 1)[0]] = f"model.layers.{layer.group(1)}.mlp.experts"
            continue
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
