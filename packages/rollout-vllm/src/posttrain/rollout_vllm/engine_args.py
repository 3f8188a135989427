"""Helpers that turn posttrain's rollout settings into vLLM's engine arguments: the dtype name, the LoRA rank
vLLM takes, whether it can return routed experts, the model's eos ids, and ``rollout.engine_kwargs`` over
posttrain's own arguments."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from posttrain.core.dtypes import dtype_name as core_dtype_name

_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (0.26 to 0.33)


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds adapters of ``rank`` (vLLM pads smaller ranks)."""
    for allowed in _LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"model.lora_rank={rank}: vLLM serves LoRA adapters of rank at most {_LORA_RANKS[-1]}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """vLLM's name for a rollout dtype given as a string (``bf16``, ``bfloat16``...) or a torch dtype."""
    return core_dtype_name(dtype, "rollout.dtype")


def routed_experts_supported() -> bool:
    """True when the installed vLLM can return the experts its MoE layers chose
    (``enable_return_routed_experts``, seen in vLLM 0.26 and 0.33); a ValueError naming the fix otherwise."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise ValueError(
            f"rollout.return_routed_experts=true needs a vLLM that returns routed experts "
            f"(EngineArgs.enable_return_routed_experts, vLLM 0.26 or newer); vLLM {vllm.__version__} is "
            "installed: upgrade vLLM, use rollout.name=hf, or use actor.engine.router_replay.mode=R2"
        )
    return True


def eos_token_ids(model_path: str) -> list[int]:
    """eos ids from the model's config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


def with_user_kwargs(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``rollout.engine_kwargs`` over posttrain's engine arguments: theirs win, key by key, and a
    ``compilation_config`` dict is merged into posttrain's (so ``{"cudagraph_mode": "FULL"}`` keeps the
    decode-graph capture size posttrain sets above 512 sequences, unless it names one itself)."""
    merged = {**ours, **theirs}
    mine, given = ours.get("compilation_config"), theirs.get("compilation_config")
    if isinstance(mine, dict) and isinstance(given, dict):
        merged["compilation_config"] = {**mine, **given}
    return merged
