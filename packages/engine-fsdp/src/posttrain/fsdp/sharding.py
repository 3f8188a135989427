"""Sharding a HF model with FSDP2 or FSDP1, and moving FSDP1's flat parameters between devices.

FSDP2 (``fully_shard``) wraps every decoder layer (the classes in the model's ``_no_split_modules``, or those
named by ``wrap_policy.transformer_layer_cls_to_wrap``) and then the root, with a ``MixedPrecisionPolicy``
(parameters gathered in the compute dtype, gradients reduced in fp32), ``reshard_after_forward`` and
optionally ``CPUOffloadPolicy``. With ``0 < fsdp_size < world`` the mesh is 2-D
``(ddp, fsdp)``: parameters are sharded inside groups of ``fsdp_size`` ranks and replicated across groups
(HSDP). FSDP1 wraps the same decoder layers through ``ModuleWrapPolicy``, or every subtree of at least
``wrap_policy.min_num_params`` parameters through ``size_based_auto_wrap_policy`` when that is > 0.

The global gradient norm and the optimizer-state and gradient moves are engine-core's
(:mod:`posttrain.core.optimizer`), shared with the torchtitan engine.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .config import FSDPEngineConfig


def decoder_layer_classes(hf_model: torch.nn.Module, names: list[str] | None = None) -> tuple[type, ...]:
    """The module classes called ``names`` in ``hf_model`` (default: the model's ``_no_split_modules``)."""
    if names is not None:
        present = {type(m).__name__: type(m) for m in hf_model.modules()}
        unknown = [n for n in names if n not in present]
        if unknown:
            raise ValueError(
                f"engine.wrap_policy.transformer_layer_cls_to_wrap names {unknown}, which "
                f"{type(hf_model).__name__} does not contain: use class names of its modules, e.g. "
                f"{sorted(getattr(hf_model, '_no_split_modules', None) or present)[:4]}, or null"
            )
        return tuple(present[n] for n in names)
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    classes = {type(m) for m in hf_model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"{type(hf_model).__name__} declares no _no_split_modules decoder layers to shard: "
            "use a Hugging Face model class that sets _no_split_modules"
        )
    return tuple(classes)


def build_mesh(device_type: str, fsdp_size: int) -> Any:
    """1-D ``(fsdp,)`` mesh over the world, or 2-D ``(ddp, fsdp)`` for HSDP when ``0 < fsdp_size < world``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if fsdp_size <= 0 or fsdp_size >= world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    if world % fsdp_size:
        raise ValueError(
            f"engine.fsdp_size={fsdp_size} does not divide the world size {world}: use a divisor "
            f"of {world} or -1"
        )
    return init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def _dtype(name: str) -> torch.dtype:
    from posttrain.core.dtypes import parse_dtype

    return parse_dtype(name)


def mixed_precision_dtypes(cfg: FSDPEngineConfig) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(param, reduce, buffer) dtypes: ``mixed_precision`` if set, else compute dtype / fp32 / fp32."""
    mp = cfg.mixed_precision or {}
    return (
        _dtype(mp.get("param_dtype", cfg.dtype)),
        _dtype(mp.get("reduce_dtype", "float32")),
        _dtype(mp.get("buffer_dtype", "float32")),
    )


def apply_fsdp2(module: torch.nn.Module, layers: tuple[type, ...], mesh: Any, cfg: FSDPEngineConfig) -> None:
    """``fully_shard`` each decoder layer, then the root, in place."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype, reduce_dtype, _ = mixed_precision_dtypes(cfg)
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": cfg.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True
        ),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if cfg.offload_policy
        else OffloadPolicy(),
    }
    for sub in module.modules():
        if isinstance(sub, layers):
            fully_shard(sub, **kwargs)
    fully_shard(module, **kwargs)


def apply_fsdp1(
    module: torch.nn.Module,
    layers: tuple[type, ...],
    mesh: Any,
    cfg: FSDPEngineConfig,
    device: torch.device,
    use_orig_params: bool,
) -> torch.nn.Module:
    """Wrap with FSDP1 (:func:`fsdp1_auto_wrap_policy`; HYBRID_SHARD on a 2-D mesh)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    param_dtype, reduce_dtype, buffer_dtype = mixed_precision_dtypes(cfg)
    strategy = ShardingStrategy.HYBRID_SHARD if mesh.ndim == 2 else ShardingStrategy.FULL_SHARD
    auto_wrap = fsdp1_auto_wrap_policy(layers, cfg.wrap_policy.min_num_params)
    return FSDP(
        module,
        auto_wrap_policy=auto_wrap,
        sharding_strategy=strategy,
        mixed_precision=MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype
        ),
        device_mesh=mesh,
        device_id=device,
        forward_prefetch=cfg.forward_prefetch,
        use_orig_params=use_orig_params,
        sync_module_states=False,
    )


def fsdp1_auto_wrap_policy(layers: tuple[type, ...], min_num_params: int = 0) -> Any:
    """Every ``layers`` module as a unit, or (``min_num_params > 0``) every subtree of that many
    parameters."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if min_num_params > 0:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    return ModuleWrapPolicy(set(layers))


def fsdp1_handles(module: torch.nn.Module) -> list[Any]:
    return list(getattr(module, "_all_handles", []))


@torch.no_grad()
def move_fsdp1_params(module: torch.nn.Module, device: torch.device | str) -> None:
    """Move FSDP1 flat parameters (the local shards) and keep FSDP's shard pointer on the new storage."""
    for handle in fsdp1_handles(module):
        if handle._offload_params:
            continue
        flat = handle.flat_param
        handle.flat_param_to(torch.device(device), non_blocking=True)
        flat._local_shard = flat.data
