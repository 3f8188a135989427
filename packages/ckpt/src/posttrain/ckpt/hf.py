"""Hugging Face side of a checkpoint: config/tokenizer files, sharded safetensors, and export from DCP.

The export reads only the ``model.*`` tensors of a DCP checkpoint into full (unsharded) CPU tensors in one
process with no process group (DCP reassembles each tensor from however many ranks wrote it), then writes
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``,
the layout ``from_pretrained`` reads. With ``tie_word_embeddings`` the ``lm_head.weight`` copy is dropped, as
``save_pretrained`` does. A LoRA role's adapters are merged into the base weights
(:mod:`posttrain.ckpt.lora`), or written alone as a peft adapter directory. No transformers or peft import is
needed here.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .layout import DIST_CKPT, HF_DIR, ROLE_MANIFEST, atomic_write_text, read_json
from .lora import adapter_state, is_lora_state, merge_lora
from .tied import fill_aliases
from .verify import CheckpointCorruptError, non_finite_names, raise_if, verify_role

HF_LAYOUT = "dcp-hf-names"
"""The ``layout`` of a role manifest whose DCP keys are HF names (``model.<hf name>``), the one export-hf
reads."""

MODEL_PREFIX = "model."
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_hf_metadata(
    out_dir: Path, hf_config: Any | None, model_dir: str | None, tokenizer_dir: str | None
) -> None:
    """Write config (``hf_config.save_pretrained`` or a copy of ``model_dir/config.json``), the generation
    config and the tokenizer files into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if hf_config is not None:
        hf_config.save_pretrained(str(out_dir))
    elif model_dir and (Path(model_dir) / "config.json").is_file():
        shutil.copy2(Path(model_dir) / "config.json", out_dir / "config.json")
    if model_dir and (Path(model_dir) / "generation_config.json").is_file():
        shutil.copy2(Path(model_dir) / "generation_config.json", out_dir / "generation_config.json")
    tok = Path(tokenizer_dir or model_dir or "")
    if tok.is_dir() and str(tok):
        for name in _TOKENIZER_FILES:
            if (tok / name).is_file():
                shutil.copy2(tok / name, out_dir / name)


def write_safetensors(
    out_dir: Path,
    state: dict[str, torch.Tensor],
    max_shard_bytes: int = 5 << 30,
    tie_word_embeddings: bool = False,
) -> list[str]:
    """Write ``state`` as HF safetensors shards (+ index when more than one); return the file names."""
    state = {k: v for k, v in state.items() if not (tie_word_embeddings and k == "lm_head.weight")}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    storages: set[int] = set()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        if t.untyped_storage().data_ptr() in storages:  # tied: safetensors refuses shared memory
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        names.append("model.safetensors.index.json")
    return names


def dcp_tensor_metadata(dcp_dir: Path) -> dict[str, TensorStorageMetadata]:
    """Flattened DCP key -> tensor metadata (global shape, dtype) of every tensor in ``dcp_dir``."""
    if not (dcp_dir / ".metadata").is_file():
        raise ValueError(
            f"{dcp_dir} is not a DCP checkpoint (no .metadata): pass a role directory that "
            f"contains {DIST_CKPT}/"
        )
    meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def load_full_model_state(dcp_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full model tensors (HF names) from a DCP checkpoint, on the CPU of one process.

    Names stored once as tied aliases (the role manifest's ``tied_aliases``) come back as the same tensor.
    """
    flat = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in dcp_tensor_metadata(dcp_dir).items()
        if k.startswith(MODEL_PREFIX)
    }
    if not flat:
        raise ValueError(f"{dcp_dir} holds no model tensors: it was saved without model in save_contents")
    with warnings.catch_warnings():  # no_dist=True is the intent here
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(dcp_dir)), no_dist=True)
    state = {k[len(MODEL_PREFIX) :]: (v.to(dtype) if dtype is not None else v) for k, v in flat.items()}
    manifest = read_json(dcp_dir.parent / ROLE_MANIFEST) or {}
    return fill_aliases(state, manifest.get("tied_aliases", {}))


def export_hf(
    role_dir: Path,
    out_dir: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    adapter_only: bool = False,
) -> list[str]:
    """Write a loadable HF model directory from a checkpoint role directory; return the weight files.

    The role's files are verified against their checksums first and weights holding NaN or inf are refused
    (:class:`~posttrain.ckpt.verify.CheckpointCorruptError`), before anything is written.

    A LoRA role (peft names, adapter config in the manifest) is written with its adapters merged into the base
    weights, or with ``adapter_only`` as a peft adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``) for ``PeftModel.from_pretrained`` on the base model.
    """
    layout = (read_json(role_dir / ROLE_MANIFEST) or {}).get("layout", HF_LAYOUT)
    if layout != HF_LAYOUT:
        raise ValueError(
            f"{role_dir} holds layout {layout!r} (keyed by the training backend's own names), not the "
            f"HF-keyed {HF_LAYOUT!r} export-hf reads: for a native Megatron checkpoint run `posttrain "
            f"convert megatron-to-hf --input {role_dir} --output {out_dir}`, or save with "
            "<role>.engine.portable_checkpoint=true"
        )
    hf_src = role_dir / HF_DIR
    if not (hf_src / "config.json").is_file():
        raise ValueError(
            f"{hf_src}/config.json is missing: export-hf needs the role directory of a posttrain "
            "checkpoint (global_step_N/<role>), which holds huggingface/config.json"
        )
    if not (role_dir / ROLE_MANIFEST).is_file():
        dcp_tensor_metadata(role_dir / DIST_CKPT)  # not a checkpoint role at all: say that first
    raise_if(verify_role(role_dir), f"export-hf: checkpoint {role_dir}")
    state = load_full_model_state(role_dir / DIST_CKPT)
    bad = non_finite_names(state)
    if bad:
        raise CheckpointCorruptError(
            f"export-hf: {role_dir} holds non-finite weights, first {bad[0]!r} ({len(bad)} tensor(s) with "
            "NaN or inf): nothing was written; export an earlier step"
        )
    peft_config = _saved_peft_config(role_dir, state)
    if adapter_only:
        return _write_adapter(role_dir, out_dir, state, peft_config, dtype)
    if peft_config is not None:
        state = merge_lora(state, peft_config)
    state = _cast(state, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in hf_src.iterdir():
        if src.is_file() and not src.name.startswith("model") and src.suffix != ".safetensors":
            shutil.copy2(src, out_dir / src.name)
    config = json.loads((out_dir / "config.json").read_text())
    dtypes = {v.dtype for v in state.values()}
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPE_NAMES:
        config["dtype"] = _DTYPE_NAMES[next(iter(dtypes))]
        config.pop("torch_dtype", None)
        atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return write_safetensors(out_dir, state, max_shard_bytes, bool(config.get("tie_word_embeddings", False)))


def _saved_peft_config(role_dir: Path, state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The manifest's peft adapter configs when ``state`` holds LoRA tensors, else None."""
    if not is_lora_state(state):
        return None
    peft_config = (read_json(role_dir / ROLE_MANIFEST) or {}).get("peft_config")
    if not peft_config:
        raise ValueError(
            f"{role_dir} holds LoRA tensors but its {ROLE_MANIFEST} records no peft_config (saved by an "
            "older posttrain-ckpt, or from a module that is not a peft model): re-save the role with "
            "RoleInfo(peft_config={adapter: LoraConfig.to_dict()}), or load it into the peft model and "
            "call merge_and_unload"
        )
    return peft_config


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` in ``dtype``; names that share a tensor (tied) still share the cast one."""
    if dtype is None:
        return state
    cast: dict[int, torch.Tensor] = {}
    return {k: cast.setdefault(id(v), v.to(dtype)) for k, v in state.items()}


def _write_adapter(
    role_dir: Path,
    out_dir: Path,
    state: dict[str, torch.Tensor],
    peft_config: dict[str, Any] | None,
    dtype: torch.dtype | None,
) -> list[str]:
    if peft_config is None:
        raise ValueError(f"{role_dir} holds no LoRA adapter: export it without --adapter-only")
    if len(peft_config) != 1:
        raise ValueError(
            f"{role_dir} has {len(peft_config)} peft adapters ({sorted(peft_config)}): --adapter-only writes "
            "exactly one"
        )
    name, config = next(iter(peft_config.items()))
    tensors = {k: v.contiguous() for k, v in _cast(adapter_state(state, name), dtype).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {**config, "inference_mode": True}
    atomic_write_text(out_dir / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ["adapter_model.safetensors", "adapter_config.json"]


def tensor_table(dcp_dir: Path) -> Iterable[tuple[str, tuple[int, ...], str, int]]:
    """(key, global shape, dtype, bytes) of every tensor in a DCP checkpoint, sorted by key."""
    for key, m in sorted(dcp_tensor_metadata(dcp_dir).items()):
        numel = 1
        for d in m.size:
            numel *= d
        yield (
            key,
            tuple(m.size),
            str(m.properties.dtype).removeprefix("torch."),
            numel * m.properties.dtype.itemsize,
        )
