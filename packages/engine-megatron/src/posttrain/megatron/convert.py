"""Offline HF <-> Megatron conversion through Megatron-Bridge.

``hf_to_megatron`` builds the Megatron model at the requested TP/PP/EP layout, loads the HF safetensors into
it through the bridge and writes a Megatron dist_ckpt (model only) plus the HF config files, in the same
layout as an engine's role directory (``<out>/dist_ckpt``, ``<out>/huggingface``). ``megatron_to_hf`` builds
the model from ``<in>/huggingface``'s config at whatever layout the current processes give, loads the
dist_ckpt (resharding as needed) and writes HF safetensors from the bridge's
streaming export. Both keep the checkpoint's dtype, so a round trip
reproduces every tensor bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from posttrain.ckpt.layout import ROLE_MANIFEST
from posttrain.ckpt.verify import raise_if, verify_role
from posttrain.core.dtypes import DTYPES

from . import build, checkpoint
from .config import McoreEngineConfig


def _dtype_of(hf_dir: Path) -> str:
    cfg = json.loads((hf_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return name if name in DTYPES else "float32"


def ensure_process_group(world_size: int) -> None:
    """Use torchrun's process group, or start a one-rank gloo group when ``world_size`` is 1."""
    if torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != world_size:
            raise ValueError(
                f"the layout needs {world_size} processes but {torch.distributed.get_world_size()} "
                f"are running: launch with `torchrun --nproc-per-node {world_size}`"
            )
        return
    if world_size != 1 and "RANK" not in os.environ:
        raise ValueError(
            f"the layout needs {world_size} processes: launch with "
            f"`torchrun --nproc-per-node {world_size} -m posttrain.megatron.convert_cli ...`"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    else:
        torch.distributed.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _layout(tp: int, pp: int, ep: int, dtype: str) -> McoreEngineConfig:
    return McoreEngineConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=False,
        dtype=dtype,
        use_distributed_optimizer=False,
        forward_only=True,
    )


def _build(hf_dir: Path, cfg: McoreEngineConfig, config_only: bool) -> tuple[object, list[torch.nn.Module]]:
    build.init_model_parallel(cfg, cfg.seed)
    bridge = build.make_bridge(str(hf_dir), config_only=config_only)
    provider = build.make_provider(bridge, cfg, on_cuda=torch.cuda.is_available())
    chunks = build.build_model(provider, cfg, wrap_with_ddp=False, on_cuda=torch.cuda.is_available())
    return bridge, chunks


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in checkpoint.HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def hf_to_megatron(hf_model: str, output: str, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """HF safetensors directory -> ``output/dist_ckpt`` (+ ``output/huggingface`` config files)."""
    from megatron.core import dist_checkpointing

    hf_dir, out = Path(hf_model), Path(output)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(
            f"--hf-model {hf_model!r} has no config.json: pass a local Hugging Face model directory"
        )
    ensure_process_group(tp * pp * ep)
    bridge, chunks = _build(hf_dir, _layout(tp, pp, ep, _dtype_of(hf_dir)), config_only=False)
    bridge.load_hf_weights(chunks)
    ckpt = out / "dist_ckpt"
    if torch.distributed.get_rank() == 0:
        if ckpt.exists():
            shutil.rmtree(ckpt)
        ckpt.mkdir(parents=True)
        _copy_side_files(hf_dir, out / "huggingface")
    torch.distributed.barrier()
    dist_checkpointing.save(checkpoint.model_sharded_state_dict(chunks), str(ckpt))
    torch.distributed.barrier()


def megatron_to_hf(input_dir: str, output: str, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """``input_dir/dist_ckpt`` (+ ``input_dir/huggingface`` config) -> HF safetensors in ``output``."""
    src, out = Path(input_dir), Path(output)
    hf_dir = src / "huggingface"
    if not (src / "dist_ckpt").is_dir() or not (hf_dir / "config.json").is_file():
        raise ValueError(
            f"--input {input_dir!r} needs dist_ckpt/ and huggingface/config.json (a directory written "
            "by `posttrain convert hf-to-megatron` or an engine save)"
        )
    ensure_process_group(tp * pp * ep)
    if (src / ROLE_MANIFEST).is_file():  # an engine save: its files against their checksums before any read
        raise_if(verify_role(src), f"posttrain convert megatron-to-hf: checkpoint {src}")
    bridge, chunks = _build(hf_dir, _layout(tp, pp, ep, _dtype_of(hf_dir)), config_only=True)
    checkpoint.load_model_dist(chunks, src / "dist_ckpt")
    if torch.distributed.get_rank() == 0:
        _copy_side_files(hf_dir, out)
    torch.distributed.barrier()
    write_safetensors(bridge.export_hf_weights(chunks, cpu=True, show_progress=False), out)
    torch.distributed.barrier()


def write_safetensors(
    stream: Iterable[tuple[str, torch.Tensor]], out: Path, shard_bytes: int = 5 << 30
) -> None:
    """Write an HF-named tensor stream as ``model.safetensors`` (or shards + index) from rank 0.

    Every rank iterates the stream (the export gathers TP/PP/EP shards collectively); only rank 0 writes."""
    from safetensors.torch import save_file

    rank0 = torch.distributed.get_rank() == 0
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in stream:
        if not rank0:
            continue
        if size and size + tensor.numel() * tensor.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().cpu().contiguous()
        size += tensor.numel() * tensor.element_size()
    if not rank0:
        return
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
