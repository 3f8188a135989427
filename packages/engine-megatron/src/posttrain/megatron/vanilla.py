"""The deprecated standalone ``mbridge`` package (``engine.vanilla_mbridge=true``) behind the bridge calls the
engine makes.

``VanillaBridge`` builds the model chunks with ``mbridge.AutoBridge.from_pretrained(dir).get_model(...)`` and
offers the Megatron-Bridge methods the engine and its checkpoints call (``load_hf_weights``,
``get_conversion_tasks``, ``export_hf_weights``, ``save_hf_weights``) over mbridge's ``load_weights``,
``export_weights`` and ``save_weights``. mbridge builds its own TransformerConfig from the HF config; posttrain
passes the layout-independent settings it also sets on Megatron-Bridge's provider (dropout off, fusions off
without CUDA, the user's ``override_transformer_config``) through ``set_extra_args``. Differences from the
Megatron-Bridge path: mbridge always uses Transformer Engine's layer spec (so Transformer Engine is required),
Megatron-FSDP and router replay are not offered (rejected by :func:`check`), and the ``posttrain convert`` commands stay on
Megatron-Bridge. Tested here only up to the missing-package error and the deprecation warning: mbridge is not
installed in posttrain's environments.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from posttrain.core.config import McoreEngineConfig

from . import _deps, build

DEPRECATION = (
    "engine.vanilla_mbridge=true builds the model through the deprecated standalone `mbridge` package; "
    "set engine.vanilla_mbridge=false to use NVIDIA Megatron-Bridge (the maintained successor)"
)
"""The DeprecationWarning every vanilla build emits."""


def check(cfg: McoreEngineConfig) -> None:
    """Warn that the path is deprecated, import ``mbridge`` (ImportError with the install hint) and reject what
    it cannot do."""
    warnings.warn(DEPRECATION, DeprecationWarning, stacklevel=3)
    _deps.import_vanilla_mbridge()
    if cfg.use_megatron_fsdp:
        raise ValueError(
            "engine.vanilla_mbridge=true with engine.use_megatron_fsdp=true: the mbridge path wraps models in "
            "Megatron DDP only; set engine.use_megatron_fsdp=false or engine.vanilla_mbridge=false"
        )
    if cfg.router_replay.mode != "disabled":
        raise ValueError(
            f"engine.vanilla_mbridge=true with engine.router_replay.mode={cfg.router_replay.mode}: router "
            "replay is wired through Megatron-Bridge's provider only; set engine.vanilla_mbridge=false"
        )


class VanillaBridge:
    """An ``mbridge`` Bridge for one HF directory, with the Megatron-Bridge method names the engine calls."""

    def __init__(self, model_path: str, cfg: McoreEngineConfig, *, on_cuda: bool, trust_remote_code: bool):
        mbridge = _deps.import_vanilla_mbridge()
        self.model_path = model_path
        self.cfg = cfg
        self.bridge = mbridge.AutoBridge.from_pretrained(
            model_path, trust_remote_code=trust_remote_code, dtype=build.TORCH_DTYPES[cfg.dtype]
        )
        extra: dict[str, Any] = {"attention_dropout": 0.0, "hidden_dropout": 0.0}
        extra["moe_router_load_balancing_type"] = "none"
        if not on_cuda:
            extra.update({name: False for name in build.CPU_OFF_FUSIONS})
        extra.update(cfg.override_transformer_config)
        self.bridge.set_extra_args(**extra)

    def build_model(self, *, wrap_with_ddp: bool, on_cuda: bool, value_head: Any = None) -> list:
        """This rank's model chunks (one per virtual pipeline stage), wrapped in Megatron DDP when training."""
        callbacks = [] if value_head is None else [lambda model, **_: value_head([model])]
        ddp = dataclasses.asdict(build.make_ddp_config(self.cfg)) if wrap_with_ddp else None
        return self.bridge.get_model(
            wrap_with_ddp=wrap_with_ddp,
            fp16=self.cfg.dtype == "float16",
            bf16=self.cfg.dtype == "bfloat16",
            use_cpu_initialization=not on_cuda,
            ddp_config=ddp,
            post_model_creation_callbacks=callbacks,
        )

    def load_hf_weights(self, chunks: list, allowed_mismatched_params: Any = None) -> None:
        """HF safetensors into the chunks (mbridge skips the LM head of a value model by itself)."""
        self.bridge.load_weights(chunks, self.model_path)

    def get_conversion_tasks(self, chunks: list) -> None:
        """mbridge has no reusable conversion plan."""
        return None

    def export_hf_weights(self, chunks: list, cpu: bool = False, show_progress: bool = False, **_: Any):
        """``(hf_name, full tensor)`` pairs, like Megatron-Bridge's ``export_hf_weights``."""
        for name, tensor in self.bridge.export_weights(chunks):
            yield name, tensor.cpu() if cpu else tensor

    def save_hf_weights(
        self, chunks: list, path: str | Path, show_progress: bool = False, memory_efficient: bool = False
    ) -> None:
        """Safetensors of the full model into ``path`` (rank 0 writes)."""
        self.bridge.save_weights(chunks, str(path), memory_efficient=memory_efficient)
