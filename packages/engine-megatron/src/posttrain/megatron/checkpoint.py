"""Megatron engine checkpoints: Megatron dist_ckpt (torch_dist, reshardable over TP/PP/DP) plus an HF folder.

Layout of one role directory::

    <role dir>/dist_ckpt/     model (``model`` or ``model<i>`` per VPP chunk), optimizer, extra (LR step)
    <role dir>/huggingface/   config + tokenizer files; safetensors too when ``hf_model`` is saved
    <role dir>/extra/rng_rank<r>.pt   torch / Megatron RNG-tracker state of rank r
    <role dir>/transformer_config.json
    <role dir>/manifest.json  checksums of every tensor and file, written last (:mod:`.verified`)

The model and optimizer go through ``megatron.core.dist_checkpointing`` with the sharded state dicts of the
model chunks and of Megatron's optimizer, so a checkpoint written at one TP/PP/DP layout loads at another;
with ``checkpoint.async_save`` the dist_ckpt files are written on the step manager's background writer
(:mod:`.async_save`; a portable checkpoint's files through :mod:`.portable` on the same writer). Under
Megatron-FSDP ``dist_ckpt/`` holds the fsdp_dtensor format instead (torch DCP over DTensors, reshardable over
DP: :mod:`.fsdp_dtensor`).
The HF weights go through Megatron-Bridge's ``save_hf_weights`` with ``engine.hf_save_kwargs`` keyword
arguments (a key its signature does not take is refused at engine start). Every save records checksums and
writes ``manifest.json`` last; every load verifies them first (:mod:`.verified`, :mod:`.portable`).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from posttrain.ckpt import read_role_manifest, retain_role_saves
from posttrain.ckpt.layout import ROLE_MANIFEST
from posttrain.core.dtypes import parse_dtype

from . import _deps, async_save, build, fsdp_dtensor, lora, portable, verified

STEP_FILE = "step.json"
"""``<role>/extra/step.json``: the ``global_step`` the role was saved at (rank 0 writes it with ``extra``)."""

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""Files copied from the model directory into ``huggingface/`` on every save."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """``{"model": ...}`` (or ``model0``, ``model1``... per VPP chunk) of Megatron sharded tensors."""
    if len(chunks) == 1:
        return {"model": build.unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": build.unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _load_model_state(
    chunks: list[torch.nn.Module], state: dict[str, Any], fresh_adapters: bool = False
) -> None:
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        module = build.unwrap(chunk)
        module.load_state_dict(lora.load_keys(module, state[key], fresh_adapters=fresh_adapters), strict=True)


def load_model_dist(chunks: list[torch.nn.Module], path: str | os.PathLike, prefix: str = "") -> None:
    """Load model weights only from a dist_ckpt directory (``engine.use_dist_checkpointing``)."""
    from megatron.core import dist_checkpointing

    ckpt = Path(path)
    if (ckpt / "dist_ckpt").is_dir():
        ckpt = ckpt / "dist_ckpt"
    if not ckpt.is_dir():
        raise ValueError(
            f"dist_checkpointing_path={str(path)!r} is not a directory: write one with "
            "`posttrain convert hf-to-megatron` or point at <role dir>/dist_ckpt"
        )
    sharded = model_sharded_state_dict(chunks)
    if prefix:
        sharded = {k: v for k, v in sharded.items() if k.startswith(prefix)}
    sharded = {k: lora.drop_adapters(v) for k, v in sharded.items()}  # a base model: adapters start fresh
    _load_model_state(chunks, dist_checkpointing.load(sharded, str(ckpt)), fresh_adapters=True)


def _sharded(engine: Any, contents: list[str], is_loading: bool) -> dict[str, Any]:
    state: dict[str, Any] = {}
    model_sd = model_sharded_state_dict(engine.chunks)
    if "model" in contents:
        state.update(model_sd)
    if "optimizer" in contents and engine.optimizer is not None:
        cfg = engine.engine_config
        sharding = "fully_reshardable" if cfg.dist_ckpt_optim_fully_reshardable else "dp_reshardable"
        metadata = {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}
        if cfg.distrib_optim_fully_reshardable_mem_efficient:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=metadata
        )
    if "extra" in contents:
        state["extra"] = {"lr_step": engine._lr_step, "skipped_steps": engine.skipped_steps}
    return state


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_hf(engine: Any, hf_dir: Path, with_weights: bool) -> None:
    if _rank() == 0:
        hf_dir.mkdir(parents=True, exist_ok=True)
        for name in HF_SIDE_FILES:
            src = Path(engine.model_config.path) / name
            if src.is_file():
                shutil.copy2(src, hf_dir / name)
    if with_weights:
        kwargs = hf_save_kwargs(engine.engine_config)  # checked at engine start (check_hf_save_kwargs)
        engine.bridge.save_hf_weights(engine.chunks, hf_dir, show_progress=False, **kwargs)


def hf_save_kwargs(cfg: Any) -> dict[str, Any]:
    """``engine.hf_save_kwargs`` as ``save_hf_weights`` takes them: a ``weight_dtype`` name becomes its torch
    dtype."""
    kwargs = dict(cfg.hf_save_kwargs)
    if isinstance(kwargs.get("weight_dtype"), str):
        kwargs["weight_dtype"] = parse_dtype(kwargs["weight_dtype"], "engine.hf_save_kwargs.weight_dtype")
    return kwargs


def check_hf_save_kwargs(cfg: Any) -> None:
    """Refuse ``engine.hf_save_kwargs`` keys that the installed bridge's ``save_hf_weights`` does not take
    (the model, the path and ``show_progress`` are the engine's); run at engine start."""
    if not cfg.hf_save_kwargs:
        return
    if cfg.vanilla_mbridge:
        from .vanilla import VanillaBridge as bridge_cls
    else:
        bridge_cls = _deps.import_bridge().AutoBridge
    params = list(inspect.signature(bridge_cls.save_hf_weights).parameters.values())[3:]  # self, model, path
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = sorted(p.name for p in params if p.kind in keyword and p.name != "show_progress")
    bad = sorted(k for k in cfg.hf_save_kwargs if k not in accepted)
    if bad:
        raise ValueError(
            f"engine.hf_save_kwargs has {bad}, which {bridge_cls.__name__}.save_hf_weights of the installed "
            f"{'mbridge' if cfg.vanilla_mbridge else 'Megatron-Bridge'} does not take (it takes {accepted}): "
            f"remove {bad} from engine.hf_save_kwargs or use one of those keys"
        )
    hf_save_kwargs(cfg)  # a weight_dtype that names no dtype is refused here too


def _finished(role_dir: Path) -> bool:
    """A role directory whose save got to its last file, ``manifest.json`` (both layouts write it last)."""
    return (role_dir / ROLE_MANIFEST).is_file()


def _retain(role_dir: Path, keep: int | None, writer: Any = None) -> None:
    """Keep the newest ``keep`` finished saves of this role (:func:`posttrain.ckpt.retain_role_saves`)."""
    retain_role_saves(role_dir, keep, _finished, writer)


def _fresh_dir(path: Path) -> None:
    """An empty ``path`` (``<role>/dist_ckpt``), and no role manifest until this save has written it."""
    if _rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        (path.parent / ROLE_MANIFEST).unlink(missing_ok=True)
    _barrier()


def _write_side_files(engine: Any, root: Path, contents: list[str], global_step: int) -> None:
    """RNG per rank (restored only at the same world size and rank) and the step (``extra/step.json``),
    huggingface/, transformer_config.json."""
    if "extra" in contents:
        (root / "extra").mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), root / "extra" / f"rng_rank{_rank()}.pt")
        if _rank() == 0:
            (root / "extra" / STEP_FILE).write_text(json.dumps({"global_step": global_step}))
    _write_hf(engine, root / "huggingface", "hf_model" in contents)
    if _rank() == 0:
        config = build.config_to_dict(build.unwrap(engine.chunks[0]).config)
        (root / "transformer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))


def _check_async(engine: Any, writer: Any) -> None:
    engine.engine_config.check_checkpoint(engine.checkpoint_config)  # no async Megatron-FSDP
    if engine.checkpoint_config.async_save and writer is None:
        raise ValueError(
            "checkpoint.async_save=true needs the background writer of the step's CheckpointManager: "
            "call engine.save_checkpoint(path, global_step=..., writer=manager.writer), or set "
            "checkpoint.async_save=false"
        )


def wait_for_pending_save(engine: Any) -> None:
    """Block until this engine's previous async save is written; re-raise its error."""
    pending, engine._pending_save = getattr(engine, "_pending_save", None), None
    if pending is not None:
        pending.result()


def save(
    engine: Any, local_path: str, global_step: int, max_ckpt_to_keep: int | None, writer: Any = None
) -> None:
    """Write ``checkpoint.save_contents`` of ``engine`` under ``local_path`` (a role directory).

    With ``checkpoint.async_save`` pass the step manager's ``writer`` (:class:`posttrain.ckpt.AsyncWriter`):
    the call returns after the planning and the host snapshot, and the dist_ckpt files are written on its
    thread.
    ``max_ckpt_to_keep`` (else ``checkpoint.max_ckpt_to_keep``) prunes older ``global_step_<N>`` siblings once
    this save is written, when ``local_path`` is ``<root>/global_step_<N>/<role>`` (:func:`_retain`).
    """
    keep = max_ckpt_to_keep if max_ckpt_to_keep is not None else engine.checkpoint_config.max_ckpt_to_keep
    if engine.engine_config.portable_checkpoint:  # HF-keyed, the FSDP engine's layout (portable.py)
        _check_async(engine, writer)
        background = writer if engine.checkpoint_config.async_save else None
        engine._pending_save = portable.save(engine, local_path, global_step, background)
        return _retain(Path(local_path), keep, background)
    from megatron.core import dist_checkpointing

    contents = engine.checkpoint_config.save_contents
    root = Path(local_path)
    _check_async(engine, writer)
    # checksums on the tensors' own device before anything is written or removed; nothing non-finite is saved
    record = verified.manifest(engine, contents, global_step, verified.record_tensors(engine, contents, root))
    ckpt_dir = root / "dist_ckpt"
    _fresh_dir(ckpt_dir)
    sharded = None if engine.engine_config.use_megatron_fsdp else _sharded(engine, contents, is_loading=False)
    background = writer if engine.checkpoint_config.async_save else None
    if sharded is None:
        fsdp_dtensor.save(engine, contents, ckpt_dir)
    elif background is not None:
        engine._pending_save = async_save.save(sharded, ckpt_dir, {"global_step": global_step}, writer)
    else:
        dist_checkpointing.save(sharded, str(ckpt_dir), content_metadata={"global_step": global_step})
    _write_side_files(engine, root, contents, global_step)
    _barrier()
    if background is None:
        verified.write_manifest(root, record)
    else:  # behind the dist_ckpt write on the writer's thread; the engine's next save or load waits for it
        engine._pending_save = background.submit(
            verified.write_manifest, root, record, background.process_group
        )
    _retain(root, keep, background)


def _load_state(engine: Any, ckpt_dir: Path, contents: list[str]) -> dict[str, Any]:
    """Restore model and optimizer in place; return the saved ``extra`` dict ({} when not loaded)."""
    from megatron.core import dist_checkpointing

    if engine.engine_config.use_megatron_fsdp:
        return fsdp_dtensor.load(engine, contents, ckpt_dir)
    state = dist_checkpointing.load(_sharded(engine, contents, is_loading=True), str(ckpt_dir))
    if "model" in contents:
        _load_model_state(engine.chunks, state)
    if "optimizer" in contents and engine.optimizer is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
    return dict(state.get("extra") or {})


def load(engine: Any, local_path: str) -> dict[str, int]:
    """Restore ``checkpoint.load_contents`` from ``local_path/dist_ckpt`` (any TP/PP/DP layout), or from a
    portable role directory. Returns the saved counters (``global_step``, ``skipped_steps``) when ``extra`` is
    loaded, else ``{}``."""
    if portable.is_portable(
        local_path
    ):  # HF-keyed: the FSDP engine's, or saved with engine.portable_checkpoint=true
        if getattr(engine, "lora", None) is not None:
            raise NotImplementedError(
                f"{local_path!r} is a portable (HF-keyed) checkpoint and this engine has LoRA: the portable "
                "layout has no names for Megatron's LoRA adapters; resume LoRA runs from native megatron "
                "checkpoints (engine.portable_checkpoint=false)"
            )
        portable.load(engine, local_path)
        if "extra" not in engine.checkpoint_config.load_contents:
            return {}
        step = read_role_manifest(Path(local_path))["global_step"]
        return {"global_step": int(step), "skipped_steps": engine.skipped_steps}
    ckpt_dir = Path(local_path) / "dist_ckpt"
    if not ckpt_dir.is_dir():
        raise ValueError(
            f"{str(ckpt_dir)!r} does not exist: load_checkpoint expects a role directory written by "
            "the megatron engine's save_checkpoint"
        )
    contents = engine.checkpoint_config.load_contents
    record = verified.verify_before_load(Path(local_path))  # every file against its checksums, first
    extra = _load_state(engine, ckpt_dir, contents)
    verified.check_after_load(engine, contents, Path(local_path), record)
    rng_file = Path(local_path) / "extra" / f"rng_rank{_rank()}.pt"
    if "extra" in contents and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    if "extra" not in contents or not extra:
        return {}
    engine._lr_step = int(extra["lr_step"])
    engine.skipped_steps = int(extra["skipped_steps"])
    if engine.optimizer is not None:
        engine._set_lr()
    step_file = Path(local_path) / "extra" / STEP_FILE
    step = json.loads(step_file.read_text()) if step_file.is_file() else {}  # older saves: no step file
    return {**step, "skipped_steps": engine.skipped_steps}
