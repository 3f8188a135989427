"""torchtitan 0.3.0 on a torch older than it was written for: torch 2.11, the GPU image's.

torchtitan 0.3.0 targets torch 2.14. Of what the engine uses, torch 2.11 lacks:

- ``torch.distributed.fsdp.DataParallelMeshDims``, imported at the top of ``torchtitan.distributed.fsdp`` and
  ``torchtitan.distributed.full_dtensor``. Every model package's ``__init__`` imports its ``parallelize``
  module, which imports both, so ``import torchtitan.models.qwen3.model`` fails although the model code runs
  on 2.11.
- the ``num_splits`` and ``enable_gqa`` arguments of ``torch.nn.attention.varlen.varlen_attn``, which
  torchtitan's ``VarlenAttention`` passes (``num_splits`` under flash attention 2, ``enable_gqa`` for GQA
  models).

On such a torch the engine (each step logged once):

- imports torchtitan's model modules (``model``, ``state_dict_adapter``, ``sharding``) without running their
  package's ``__init__`` (:func:`prepare_model_imports`): it registers the package as a bare namespace whose
  ``__path__`` is torchtitan's folder, so the model code is torchtitan's own, unchanged;
- shards with torch's ``fully_shard`` in the unit layout of torchtitan's ``apply_fsdp_to_decoder`` for a dense
  decoder (:func:`fully_shard_decoder`); a MoE model runs in one process only (in a process group it is
  refused before the model is built: :func:`check_moe_sharding`);
- on CUDA, runs :class:`TorchVarlenAttention`: torch's ``varlen_attn`` with key/value heads repeated to the
  query heads.

Nothing here runs at import; the checks read the installed torch (the tests hide its attributes to take this
path on a newer torch).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
import types
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn

from torchtitan.protocols.module import Module

logger = logging.getLogger(__name__)

MODEL_PACKAGES = ("torchtitan.models.qwen3", "torchtitan.models.llama3")
"""torchtitan model packages the engine imports modules from."""


def titan_fsdp_importable() -> bool:
    """True when this torch has what ``torchtitan.distributed.fsdp`` imports (torch >= 2.12)."""
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "DataParallelMeshDims")


@cache
def prepare_model_imports() -> bool:
    """Make ``torchtitan.models.{qwen3,llama3}.<module>`` importable on a torch without
    ``DataParallelMeshDims``; True when it had to (logged once). With a newer torch it does nothing."""
    if titan_fsdp_importable():
        return False
    logger.info(
        "torch %s lacks torch.distributed.fsdp.DataParallelMeshDims (torchtitan 0.3.0's FSDP module imports "
        "it, and its model packages import that module): the torchtitan engine imports torchtitan's model "
        "modules without their package __init__ and shards with torch's fully_shard in torchtitan's unit "
        "layout",
        torch.__version__,
    )
    for name in MODEL_PACKAGES:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)  # imports the parents (torchtitan.models), not the package
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{name} is not installed: pip install torchtitan==0.3.0")
        bare = importlib.machinery.ModuleSpec(name, None, is_package=True)
        bare.submodule_search_locations = list(spec.submodule_search_locations)
        package = types.ModuleType(name)
        package.__spec__, package.__path__, package.__package__ = bare, bare.submodule_search_locations, name
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        setattr(importlib.import_module(parent), child, package)
    return True


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """torchtitan's ``get_fsdp_reshard_after_forward_policy``."""
    if policy not in ("always", "never", "default"):
        raise ValueError(f"reshard_after_forward={policy!r}: use default, always or never")
    return policy == "always" or (policy == "default" and not pp_enabled)


def fully_shard_decoder(
    model: nn.Module,
    dp_mesh: Any,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    reshard_after_forward_policy: str = "default",
) -> None:
    """torchtitan 0.3.0's ``apply_fsdp_to_decoder`` for a dense decoder, with torch's ``fully_shard``: one
    unit per block; embeddings, final norm and output layer one unit when tied (else embeddings alone and norm
    + output layer together, resharded after forward only with ``always``); the root last; gradient division
    off (the caller sets it)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if any(getattr(block, "moe_enabled", False) for block in model.layers.values()):
        raise ValueError(
            f"torch {torch.__version__}: MoE blocks need torchtitan's own FSDP function, which needs torch "
            ">= 2.12 (DataParallelMeshDims); use a dense model here or a newer torch"
        )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    common = {"mesh": dp_mesh, "mp_policy": mp}
    reshard = _reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    last = reshard_after_forward_policy == "always"
    if model.enable_weight_tying:
        modules = [m for m in (model.tok_embeddings, model.norm, model.lm_head) if m is not None]
        fully_shard(modules, **common, reshard_after_forward=last)
    else:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, **common, reshard_after_forward=reshard)
        if model.norm is not None and model.lm_head is not None:
            fully_shard([model.norm, model.lm_head], **common, reshard_after_forward=last)
    for block in model.layers.values():
        fully_shard(block, **common, reshard_after_forward=reshard)
    fully_shard(model, **common)
    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)


def check_moe_sharding(is_moe: bool, distributed: bool) -> None:
    """Refuse, before the model is built, a MoE model that FSDP2 would shard on a torch without torchtitan's
    FSDP function: :func:`fully_shard_decoder` has dense decoders' unit layout only, and expert parallelism's
    sharding is torchtitan's."""
    if is_moe and distributed and not titan_fsdp_importable():
        raise ValueError(
            f"torch {torch.__version__} lacks torch.distributed.fsdp.DataParallelMeshDims, which torchtitan "
            "0.3.0's FSDP2 of MoE blocks (and expert parallelism) needs: train the MoE model in one process "
            "(without torchrun), use a dense model on several ranks, or install torch >= 2.12"
        )


def decoder_fsdp_function() -> Any:
    """torchtitan's ``apply_fsdp_to_decoder`` where this torch imports it,
    else :func:`fully_shard_decoder`."""
    if titan_fsdp_importable():
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        return apply_fsdp_to_decoder
    prepare_model_imports()
    return fully_shard_decoder


def titan_varlen_runs() -> bool:
    """True when this torch's ``varlen_attn`` takes the ``num_splits`` and ``enable_gqa`` arguments
    torchtitan's ``VarlenAttention`` passes (torch >= 2.12)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return "num_splits" in params and "enable_gqa" in params


def varlen_attention_config() -> Any:
    """torchtitan's ``VarlenAttention`` config where this torch runs it, else :class:`TorchVarlenAttention`'s
    (logged)."""
    from torchtitan.models.common.attention import VarlenAttention

    if titan_varlen_runs():
        return VarlenAttention.Config()
    logger.info(
        "torch %s's varlen_attn lacks the num_splits/enable_gqa arguments torchtitan's VarlenAttention "
        "passes: packed attention runs torch's varlen_attn directly (key/value heads repeated for GQA)",
        torch.__version__,
    )
    return TorchVarlenAttention.Config()


class TorchVarlenAttention(Module):
    """Inner attention (1, T, N, H) -> (1, T, N, H) in bfloat16, causal inside each document: torch's
    ``varlen_attn`` with ``window_size=(-1, 0)`` (CUDA only), as torchtitan's ``VarlenAttention`` calls it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any,
        scale: float | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        meta = attention_masks
        B, L, _, head_dim = q_BLNH.shape
        q, k, v = (t.reshape(B * L, -1, t.shape[-1]).to(torch.bfloat16) for t in (q_BLNH, k_BLNH, v_BLNH))
        if q.shape[1] != k.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = varlen_attn(
            q, k, v, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, scale=scale, window_size=(-1, 0)
        )
        return out.view(B, L, -1, v_BLNH.shape[-1]).to(q_BLNH.dtype)
