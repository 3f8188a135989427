"""How the FSDP engine lays its module out: one class per layout, chosen once when the engine initialises.

:class:`PlainLayout` is a process without a process group (a world of 1): the unwrapped module, autocast to
``dtype`` when that differs from ``model_dtype``. :class:`FSDP1Layout` (``FSDP1EngineConfig``) and
:class:`FSDP2Layout` (``FSDP2EngineConfig``) shard over every rank of the default group (HSDP when
``0 < fsdp_size < world``). The engine asks its layout where to build the model, how to wrap it, move it, clip
its gradients and read its state, and reads no version flag.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.optimizer import grad_norm_and_clip

from . import sharding
from .config import FSDPEngineConfig


class PlainLayout:
    """No process group: the module as built, data-parallel size 1."""

    backend = "torch"
    """The ``backend`` a checkpoint's role metadata names."""
    materialize_on_cpu = False

    def __init__(self, cfg: FSDPEngineConfig, device: torch.device) -> None:
        self.cfg, self.device, self.mesh = cfg, device, None

    def init_device(self) -> torch.device:
        """Where the model is built (on the meta device unless :attr:`meta` is False)."""
        return self.device

    meta = True
    """Build on the meta device and load the weights after wrapping."""

    def wrap(self, module: torch.nn.Module, hf_model: torch.nn.Module, is_lora: bool) -> torch.nn.Module:
        return module

    def dp_size(self) -> int:
        return 1

    def dp_rank(self) -> int:
        return 0

    def dp_group(self) -> Any:
        return None

    def reshard(self, module: torch.nn.Module) -> None:
        """Free parameters still held gathered once no backward follows (FSDP2 only)."""

    def keeps_params_on_cpu(self) -> bool:
        return False

    def move_params(self, module: torch.nn.Module, device: torch.device) -> None:
        module.to(device)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        compute, master = getattr(torch, self.cfg.dtype), getattr(torch, self.cfg.model_dtype)
        if compute == master:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=compute)

    def clip_grad_norm(self, module: torch.nn.Module, max_norm: float) -> float:
        params = [p for p in module.parameters() if p.requires_grad]
        return grad_norm_and_clip(params, max_norm, self._norm_group(), self.device)

    def _norm_group(self) -> Any:
        return None

    def state_dict_context(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The context a local-shard (no gather) ``state_dict()`` runs in."""
        return contextlib.nullcontext()

    def needs_params_on_device_to_stream(self) -> bool:
        return False


class _Sharded(PlainLayout):
    """Every rank of the default group is a data-parallel rank; mixed precision is FSDP's, not autocast."""

    def __init__(self, cfg: FSDPEngineConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.backend = cfg.strategy or "fsdp2"

    def _mesh_and_layers(self, hf_model: torch.nn.Module) -> tuple[Any, tuple[type, ...]]:
        self.mesh = sharding.build_mesh(self.device.type, self.cfg.fsdp_size)
        layers = sharding.decoder_layer_classes(hf_model, self.cfg.wrap_policy.transformer_layer_cls_to_wrap)
        return self.mesh, layers

    def dp_size(self) -> int:
        return dist.get_world_size()

    def dp_rank(self) -> int:
        return dist.get_rank()

    def dp_group(self) -> Any:
        return dist.group.WORLD

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


class FSDP2Layout(_Sharded):
    """``fully_shard`` each decoder layer and the root (optionally with the CPU offload policy)."""

    @property
    def materialize_on_cpu(self) -> bool:  # type: ignore[override]
        return self.cfg.offload_policy

    def init_device(self) -> torch.device:
        return torch.device("cpu") if self.cfg.offload_policy else self.device

    def wrap(self, module: torch.nn.Module, hf_model: torch.nn.Module, is_lora: bool) -> torch.nn.Module:
        mesh, layers = self._mesh_and_layers(hf_model)
        sharding.apply_fsdp2(module, layers, mesh, self.cfg)
        return module

    def reshard(self, module: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()

    def keeps_params_on_cpu(self) -> bool:
        return self.cfg.offload_policy

    def _norm_group(self) -> Any:
        return self.mesh.get_group("fsdp") if self.mesh.ndim == 2 else self.mesh.get_group()


class FSDP1Layout(_Sharded):
    """``FullyShardedDataParallel`` over FlatParameters, built on the CPU and moved by FSDP."""

    meta = False

    def init_device(self) -> torch.device:
        return torch.device("cpu")

    def wrap(self, module: torch.nn.Module, hf_model: torch.nn.Module, is_lora: bool) -> torch.nn.Module:
        mesh, layers = self._mesh_and_layers(hf_model)
        return sharding.apply_fsdp1(
            module, layers, mesh, self.cfg, self.device, use_orig_params=self.cfg.use_orig_params or is_lora
        )

    def move_params(self, module: torch.nn.Module, device: torch.device) -> None:
        sharding.move_fsdp1_params(module, device)

    def clip_grad_norm(self, module: torch.nn.Module, max_norm: float) -> float:
        return float(module.clip_grad_norm_(max_norm if max_norm > 0 else float("inf")))

    def state_dict_context(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

        return FSDP.state_dict_type(module, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())

    def needs_params_on_device_to_stream(self) -> bool:
        return True  # FSDP1 flat shards must be on the device to be read
