"""LoRA for the megatron engine through Megatron-Bridge's PEFT (``megatron.bridge.peft.lora.LoRA``).

``model.lora_rank > 0`` builds the bridge's ``LoRA`` (``dim=lora_rank``, ``alpha=lora_alpha``, no dropout) and
applies it to the model chunks in ``provide_distributed_model``'s pre-wrap hook, before Megatron DDP and the
optimizer exist: every base parameter is frozen, each selected linear becomes a ``LoRALinear`` (``to_wrap`` =
the base layer, ``adapter.linear_in`` = A, ``adapter.linear_out`` = B) and only A and B train (a value model's
head trains in full, as in the FSDP engine). ``load_hf_weights`` then fills the base weights.

Module names follow peft (``target_modules``, ``exclude_modules``
of :class:`posttrain.core.config.ModelConfig`):
``all-linear``, a list of names (a name matches a module whose HF name equals it or ends with ``.<name>``) or
a regex (full match), checked against the HF name of each part of a Megatron linear:

==================================  ====================================================
Megatron (``decoder.layers.N.``)    HF (``model.layers.N.``)
==================================  ====================================================
``self_attention.linear_qkv``       ``self_attn.q_proj``, ``self_attn.k_proj``, ``self_attn.v_proj``
``self_attention.linear_proj``      ``self_attn.o_proj``
``mlp.linear_fc1``                  ``mlp.gate_proj``, ``mlp.up_proj``
``mlp.linear_fc2``                  ``mlp.down_proj``
==================================  ====================================================

MoE expert linears (``mlp.experts.*``) and the router are not adapted. The mapping is coarser than peft's
where Megatron fuses layers: a fused linear is adapted when any of its HF
parts is selected, so ``target_modules=[q_proj]`` also adapts k and v, and excluding ``k_proj`` alone
excludes nothing. A fused linear has one A shared by its parts and one B that splits into the parts' Bs; the
bridge's adapter export repeats A for each part, so the exported peft adapter computes exactly what the
engine computes (it is a peft adapter whose q/k/v, or gate/up, As happen to be equal). A selection may leave a
pipeline stage without adapters (``target_modules`` naming late layers only): that stage trains nothing, and
:func:`posttrain.megatron.build.build_optimizer` keeps its gradient-clipping collectives in step with the
others.

Checkpoints: a LoRA linear's sharded state keeps the base layer's own keys and adds ``<linear>.adapter.*``, so
native ``dist_ckpt`` saves hold the adapters and a base-only ``dist_ckpt`` loads with fresh adapters
(:func:`load_keys`, :func:`drop_adapters`); the HF safetensors of ``hf_model`` are the merged model.

Weights for the rollout (:func:`rollout_stream`): merged (``W + alpha/r * B @ A`` through the bridge's
``LoRAMerge``, under HF names), the base alone, or the adapter alone under peft's saved names
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) with a peft config dict
(``LoraConfig(**d)`` loads it). Starting from an existing peft adapter (``lora_adapter_path``) is not offered:
Megatron-Bridge 0.6 exports adapters but has no HF -> Megatron adapter import, and a peft adapter with
distinct q/k/v As has no exact fused-QKV form.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from posttrain.core.config import ModelConfig

FUSED_PARTS = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
"""Megatron linear (relative to its decoder layer) -> the HF modules it holds (relative to the HF layer)."""

HF_LINEARS = tuple(part.rsplit(".", 1)[1] for parts in FUSED_PARTS.values() for part in parts)

PEFT_PREFIX = "base_model.model."


def _matches(spec: Any, hf_name: str, what: str) -> bool:
    """peft's rule: ``all-linear``, a regex (full match), or a list of names / name suffixes."""
    if spec == "all-linear":
        return hf_name.rsplit(".", 1)[1] in HF_LINEARS
    if isinstance(spec, str):
        return re.fullmatch(spec, hf_name) is not None
    if not isinstance(spec, Iterable):  # a list, or OmegaConf's ListConfig
        raise ValueError(
            f"model.{what}={spec!r} must be 'all-linear', a regex or a list of module names "
            f"such as {list(HF_LINEARS)}"
        )
    return any(hf_name == s or hf_name.endswith(f".{s}") for s in spec)


def check_config(model: ModelConfig) -> None:
    """Refuse what the megatron engine's LoRA cannot do (``ValueError`` naming the fix)."""
    if model.lora_adapter_path:
        raise ValueError(
            f"model.lora_adapter_path={model.lora_adapter_path!r}: the megatron engine cannot load a peft "
            "adapter (Megatron-Bridge 0.6 has no HF -> Megatron adapter import); use the fsdp engine, or "
            "merge the adapter into the base model (peft's merge_and_unload) and point model.path at it"
        )
    spec = model.target_modules
    if isinstance(spec, Iterable) and not isinstance(spec, str):
        unknown = [s for s in spec if s.rsplit(".", 1)[-1] not in HF_LINEARS]
        if unknown:
            raise ValueError(
                f"model.target_modules has {unknown}, which the megatron engine cannot adapt: use names "
                f"from {list(HF_LINEARS)} (optionally with their HF path, e.g. model.layers.0.mlp.up_proj) "
                "or 'all-linear'"
            )
    _matches(spec, "model.layers.0.mlp.up_proj", "target_modules")
    if model.exclude_modules is not None:
        _matches(model.exclude_modules, "model.layers.0.mlp.up_proj", "exclude_modules")


def _select(model: ModelConfig, chunks: list[torch.nn.Module]) -> tuple[list[str], list[str]]:
    """(Megatron module names to adapt, HF module names they hold) over this rank's chunks."""
    chosen, hf_names = [], []
    for chunk in chunks:
        for layer_name, layer in chunk.named_modules():
            number = getattr(layer, "layer_number", None)  # global, 1-based (offset by the PP/VPP stage)
            if number is None or not re.search(r"(^|\.)layers\.\d+$", layer_name):
                continue
            for rel, parts in FUSED_PARTS.items():
                hf = [f"model.layers.{number - 1}.{p}" for p in parts]
                if _has_submodule(layer, rel) and any(_selected(model, n) for n in hf):
                    chosen.append(f"{layer_name}.{rel}")
                    hf_names.extend(hf)
    return chosen, hf_names


def _selected(model: ModelConfig, hf_name: str) -> bool:
    excluded = model.exclude_modules is not None and _matches(
        model.exclude_modules, hf_name, "exclude_modules"
    )
    return not excluded and _matches(model.target_modules, hf_name, "target_modules")


def _has_submodule(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _all_ranks(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (pipeline stages hold different layers)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def _adapter_wrappers(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, AdapterWrapper):
                yield name, module


class MegatronLora:
    """The bridge's LoRA on one engine's chunks: the pre-wrap hook, the base-model context and the rollout
    streams (see the module docstring)."""

    def __init__(self, model: ModelConfig, *, value_model: bool) -> None:
        check_config(model)
        self.model = model
        self.value_model = value_model
        self.peft: Any = None
        self.hf_modules: list[str] = []
        """HF names of the adapted modules, over all ranks."""
        self.num_layers = 0

    def apply(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """Pre-wrap hook: freeze the base, wrap the selected linears (collective: all ranks call it)."""
        from megatron.bridge.peft.lora import LoRA

        chosen, hf_names = _select(self.model, chunks)
        self.hf_modules = sorted({n for names in _all_ranks(hf_names) for n in names})
        if not self.hf_modules:
            raise ValueError(
                f"model.target_modules={self.model.target_modules!r} with exclude_modules="
                f"{self.model.exclude_modules!r} selects no linear layer of this model: target some of "
                f"{list(HF_LINEARS)}, or set lora_rank=0"
            )
        self.num_layers = chunks[0].config.num_layers
        self.peft = LoRA(
            target_modules=chosen, dim=self.model.lora_rank, alpha=self.model.lora_alpha, dropout=0.0
        )
        if chosen:
            chunks = self.peft(chunks, training=True)
        else:  # a stage without adapters trains nothing (or only a value head): an empty target list
            # would adapt everything. Its optimizer is empty; build.build_optimizer keeps its collectives in
            # step.
            self.peft.freeze_model(chunks, training=True)
        adapted = sorted(name for name, _ in _adapter_wrappers(chunks))
        if adapted != sorted(chosen):
            raise RuntimeError(f"the bridge's LoRA adapted {adapted}, expected {sorted(chosen)}")
        if self.value_model:  # the value head trains in full
            for chunk in chunks:
                head = getattr(chunk, "output_layer", None)
                for param in head.parameters() if head is not None else ():
                    param.requires_grad_(True)
        return chunks

    @contextlib.contextmanager
    def disable_adapter(self, chunks: list[torch.nn.Module]) -> Iterator[None]:
        """The chunks run as their base model inside the context."""
        wrappers = [module for _, module in _adapter_wrappers(chunks)]
        for module in wrappers:
            module.disable_adapter_layers()
        try:
            yield
        finally:
            for module in wrappers:
                module.enable_adapter_layers()

    def peft_config(self) -> dict[str, Any]:
        """The adapter's peft ``LoraConfig`` as a dict; ``target_modules`` are leaf names (``q_proj``) when
        the adapter covers those modules in every layer, else the full HF module names."""
        from megatron.bridge.models.conversion.peft_bridge import build_adapter_config_dict

        leaves = sorted({name.rsplit(".", 1)[1] for name in self.hf_modules})
        parents = {p.rsplit(".", 1)[1]: p for parts in FUSED_PARTS.values() for p in parts}
        every_layer = {f"model.layers.{i}.{parents[leaf]}" for i in range(self.num_layers) for leaf in leaves}
        targets = leaves if every_layer == set(self.hf_modules) else list(self.hf_modules)
        out = build_adapter_config_dict(
            self.peft, target_modules=targets, base_model_name_or_path=self.model.path
        )
        out["inference_mode"] = False
        return out


def rollout_stream(
    bridge: Any,
    chunks: list[torch.nn.Module],
    tasks: Any,
    *,
    merge: bool,
    adapter_only: bool,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors for the rollout: merged weights, the base alone, or (``adapter_only``) the adapter
    under peft's names. Collective over the model-parallel ranks: every rank consumes it to the end."""
    if adapter_only and not merge:
        stream = bridge.export_adapter_weights(chunks, cpu=False, show_progress=False)
        for name, tensor in stream:
            yield PEFT_PREFIX + name, _cast(tensor, dtype)
        return
    stream = bridge.export_hf_weights(
        chunks, cpu=False, show_progress=False, conversion_tasks=tasks, merge_adapter_weights=merge
    )
    for name, tensor in stream:  # unmerged, the bridge names base weights as peft does (``.base_layer.``)
        yield name.replace(".base_layer.", "."), _cast(tensor, dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def load_keys(
    module: torch.nn.Module, state: dict[str, Any], *, fresh_adapters: bool = False
) -> dict[str, Any]:
    """A checkpoint state of ``module`` (a GPTModel) keyed for ``module.load_state_dict``.

    A LoRA linear saves its base layer under the base layer's own names (``linear_qkv.weight``, so base-only
    checkpoints and LoRA checkpoints share keys) but holds it as ``linear_qkv.to_wrap.weight``; this renames
    those keys. With ``fresh_adapters`` (base-only checkpoint) the adapters keep their current values."""
    wrappers = [name for name, _ in _adapter_wrappers([module])]
    if not wrappers:
        return state
    out = {}
    for key, value in state.items():
        owner = next((w for w in wrappers if key.startswith(f"{w}.")), None)
        if owner is not None and not key.startswith(f"{owner}.adapter."):
            key = f"{owner}.to_wrap.{key[len(owner) + 1 :]}"
        out[key] = value
    if fresh_adapters:
        for key, value in module.state_dict(keep_vars=True).items():
            if ".adapter." in key:  # parameters, and the (None) ``_extra_state`` of the adapter's linears
                out.setdefault(key, value.detach() if isinstance(value, torch.Tensor) else value)
    return out


def drop_adapters(sharded: dict[str, Any]) -> dict[str, Any]:
    """A model's sharded state dict without its LoRA adapters (to read a base-only checkpoint)."""
    return {k: v for k, v in sharded.items() if ".adapter." not in k}
