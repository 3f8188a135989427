"""Hugging Face side of a checkpoint: config/tokenizer files, sharded safetensors, and export from DCP.

The export reads only the ``model.*`` tensors of a DCP checkpoint into full (unsharded) CPU tensors in one
process with no process group (DCP reassembles each tensor from however many ranks wrote it), then writes
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``,
the layout ``from_pretrained`` reads. With ``tie_word_embeddings`` the ``lm_head.weight`` copy is dropped, as
``save_pretrained`` does. No transformers import is needed here.
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

from .layout import DIST_CKPT, HF_DIR, atomic_write_text

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
    for name in sorted(state):
        t = state[name].detach().contiguous()
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
    """Full model tensors (HF names) from a DCP checkpoint, on the CPU of one process."""
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
    return {k[len(MODEL_PREFIX) :]: (v.to(dtype) if dtype is not None else v) for k, v in flat.items()}


def export_hf(
    role_dir: Path, out_dir: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30
) -> list[str]:
    """Write a loadable HF model directory from a checkpoint role directory; return the weight files."""
    hf_src = role_dir / HF_DIR
    if not (hf_src / "config.json").is_file():
        raise ValueError(
            f"{hf_src}/config.json is missing: export-hf needs the role directory of a posttrain "
            "checkpoint (global_step_N/<role>), which holds huggingface/config.json"
        )
    state = load_full_model_state(role_dir / DIST_CKPT, dtype)
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
