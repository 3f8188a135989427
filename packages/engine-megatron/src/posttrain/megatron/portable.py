"""Portable Megatron checkpoints: model and AdamW state keyed by HF names, in the FSDP engine's layout.

A role directory written by the FSDP engine (:func:`posttrain.ckpt.save_role`) holds, in torch DCP,
``model.<hf name>`` and the optimizer flattened per HF name
(``optimizer.state.<hf name>.exp_avg|exp_avg_sq|step``, ``optimizer.param_groups.<hf name>.lr|betas|...``),
the LR scheduler state and counters in ``dist_ckpt/extra/rank_<r>.pt``, and ``manifest.json`` with
``layout: dcp-hf-names``. This module reads and writes that layout from the megatron engine, so one checkpoint
resumes on either backend:

- **load** (any checkpoint whose manifest says ``dcp-hf-names``): per Megatron parameter, every rank reads the
  full HF tensors it needs with DCP (no collectives), converts them with Megatron-Bridge's own mapping (the
  one that loads HF weights: fused QKV, fused gate/up, TP split) and copies the result into the model
  parameter, the optimizer's fp32 main parameter and its ``exp_avg``/``exp_avg_sq``. Adam moments are
  elementwise, so they convert exactly like the parameter. ``step`` and the LR step (the torch LR scheduler's
  ``last_epoch``) carry over, as do ``skipped_steps`` and the torch RNG of the rank.
- **save** (``engine.portable_checkpoint=true``): the fp32 main parameters and Adam moments (DP shards of the
  distributed optimizer all-reduced into whole TP shards) go through the bridge's Megatron -> HF conversion
  (full tensors); each rank keeps every world-size-th HF name and one ``dcp.save`` writes them. Param groups
  and the LR scheduler state are those of the FSDP engine's ``torch.optim.AdamW`` + ``LambdaLR`` built with
  the same optimizer config, so ``load_checkpoint`` of the FSDP engine and ``posttrain ckpt export-hf`` read
  the directory unchanged.

Limits: one (non-chained) dense optimizer, i.e. no MoE; no Megatron-FSDP; no precision-aware optimizer; tied
embeddings only at PP = 1; bridge mappings must only move values (concatenate, interleave, split), which holds
for Qwen2/Llama-style models (a zero-centred-norm mapping, which shifts values, is refused). The Megatron RNG
tracker is not saved (dropout is off in posttrain's engines). Weight decay follows the engine that resumes:
Megatron exempts biases and norms, torch's AdamW does not. Loading reads every needed full tensor on every
rank (IO grows with the rank count); saving holds each rank's share of the full tensors in host memory.

With ``checkpoint.async_save`` the save blocks for the conversion and the device-to-host copy of this rank's
share (the snapshot, into the step manager's writer's reused host buffers; the conversion's collectives run on
the training thread), and the files (DCP, extra, ``huggingface/``, the manifest last) are written as one job
on :class:`posttrain.ckpt.AsyncWriter`'s thread over its gloo group. The engine waits for that job before its
next save or load, and the step manager's commit is queued behind it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from posttrain.ckpt import AsyncWriter, RoleInfo, read_role_manifest
from posttrain.ckpt.extra import capture_extra, load_extra
from posttrain.ckpt.layout import (
    DIST_CKPT,
    EXTRA_DIR,
    FORMAT,
    FORMAT_VERSION,
    ROLE_MANIFEST,
    read_json,
)
from posttrain.ckpt.role import write_role_files
from posttrain.ckpt.snapshot import snapshot_to_host
from posttrain.ckpt.verify import raise_if, verify_role

from . import build

LAYOUT = "dcp-hf-names"
"""The ``layout`` a portable role manifest carries (what the FSDP engine's checkpoints say)."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def is_portable(role_dir: str | Path) -> bool:
    """True when ``role_dir`` holds an HF-keyed DCP checkpoint (FSDP engine, or megatron with
    portable_checkpoint=true)."""
    manifest = read_json(Path(role_dir) / ROLE_MANIFEST)
    return manifest is not None and manifest.get("layout") == LAYOUT


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _check_supported(engine: Any) -> None:
    cfg = engine.engine_config
    opt = engine.optimizer
    subs = getattr(opt, "chained_optimizers", None) if opt is not None else None
    problems = ["a value model (its head has no causal-LM HF name)"] if engine.is_value_model else []
    if cfg.use_megatron_fsdp:
        problems.append("use_megatron_fsdp=true")
    if subs is not None and len(subs) > 1:
        problems.append(f"{len(subs)} chained optimizers (MoE expert parameters)")
    if opt is not None and getattr(opt.config, "use_precision_aware_optimizer", False):
        problems.append("use_precision_aware_optimizer")
    tied = build.unwrap(engine.chunks[0]).share_embeddings_and_output_weights
    if tied and cfg.pipeline_model_parallel_size > 1:
        problems.append("tied embeddings with pipeline_model_parallel_size > 1")
    if problems:
        raise NotImplementedError(
            f"the portable (HF-keyed) checkpoint does not support {', '.join(problems)}: use the native "
            "megatron checkpoint (engine.portable_checkpoint=false) for this engine"
        )


# ---------------------------------------------------------------------------------------- optimizer slots
class _Slots:
    """Where Megatron's optimizer keeps the fp32 main parameter and Adam moments of each model parameter.

    FP32Optimizer: the model parameter itself. Float16Optimizer: ``param.main_param``. DistributedOptimizer:
    the flat slice ``[start, end)`` of the parameter that this DP rank owns (absent when it owns none)."""

    def __init__(self, optimizer: Any) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        self.opt = subs[0]
        self.inner = self.opt.optimizer
        self.distributed = isinstance(self.opt, DistributedOptimizer)
        self.torch_adam = isinstance(self.inner, torch.optim.Adam | torch.optim.AdamW)

    def main(self, p: torch.Tensor) -> tuple[torch.Tensor, slice | None] | None:
        """(main parameter, slice of the flattened model parameter it holds) or None."""
        if not self.distributed:
            return getattr(p, "main_param", p), None
        index = self.opt.model_param_group_index_map.get(p)
        if index is None:
            return None
        group, order = index
        rng = self.opt._get_model_param_range_map(p)["param"]
        return self.inner.param_groups[group]["params"][order], slice(rng.start, rng.end)

    def get(self, p: torch.Tensor, kind: str) -> torch.Tensor:
        """The whole (TP-local) fp32 ``kind`` ('param' or a moment) of ``p``; collective over DP when
        sharded."""
        slot = self.main(p)
        src = None
        if slot is not None:
            main, _ = slot
            state = self.inner.state.get(main, {})
            src = main if kind == "param" else state.get(kind, torch.zeros_like(main))  # no step yet: zeros
        if not self.distributed:
            return src.detach().float().reshape(p.shape)
        out = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if slot is not None:
            out[slot[1]] = src.detach().float().reshape(-1)
        torch.distributed.all_reduce(out, group=self.opt.data_parallel_group)
        return out.reshape(p.shape)

    def set(self, p: torch.Tensor, kind: str, value: torch.Tensor) -> None:
        """Write the whole (TP-local) ``value`` of ``kind`` for ``p`` (this rank's part of it)."""
        slot = self.main(p)
        if slot is None:
            return
        main, part = slot
        flat = value.detach().reshape(-1)
        if part is not None:
            flat = flat[part]
        if kind == "param":
            with torch.no_grad():
                main.copy_(flat.reshape(main.shape))
        else:
            self.inner.state[main][kind] = flat.reshape(main.shape).to(main.device, main.dtype, copy=True)

    def step(self) -> int:
        """Adam's step count (torch Adam keeps it per parameter, TE/apex FusedAdam per param group)."""
        steps = [0]
        for group in self.inner.param_groups:
            for main in group["params"]:
                state = self.inner.state.get(main, {})
                if "step" in state:
                    steps.append(int(state["step"]))
            steps.append(int(group.get("step", 0)))
        device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces CUDA tensors only
        step = torch.tensor([max(steps)], dtype=torch.float64, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX)
        return int(step)

    def set_step(self, step: int) -> None:
        for group in self.inner.param_groups:
            if not self.torch_adam:
                group["step"] = step
                continue
            for main in group["params"]:
                self.inner.state[main]["step"] = torch.tensor(float(step), dtype=torch.float32)


# ---------------------------------------------------------------------------------------- FSDP-side templates
def _template(optimizer_config: Any, lr_step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(param group without params, LR scheduler state) of the FSDP engine's AdamW + LambdaLR at
    ``lr_step``."""
    oc = optimizer_config
    dummy = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW(
        [dummy], lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: oc.lr_multiplier(step))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        for _ in range(lr_step):
            sched.step()
    group = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "param_names")}
    return group, sched.state_dict()


class _SchedulerState:
    """Receives the saved LR scheduler state from :func:`posttrain.ckpt.extra.load_extra`."""

    state: dict[str, Any] | None = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


# ---------------------------------------------------------------------------------------- conversion
def _tasks(engine: Any) -> list[Any]:
    """Fresh bridge conversion tasks (not the engine's export cache: PP broadcasts cache tensor specs)."""
    tasks = [t for t in engine.bridge.get_conversion_tasks(engine.chunks) if t is not None]
    from megatron.bridge.models.conversion.param_mapping import RMSNorm2ZeroCenteredRMSNormMapping

    for task in tasks:
        if getattr(task.mapping, "is_grouped_export", False) or isinstance(
            task.mapping, RMSNorm2ZeroCenteredRMSNormMapping
        ):
            # grouped experts are gathered across tasks; a zero-centred norm shifts values (Adam moments
            # must not be shifted)
            raise NotImplementedError(
                f"{task.global_param_name} converts through {type(task.mapping).__name__}, which the "
                "portable checkpoint does not support: use engine.portable_checkpoint=false"
            )
    return tasks


def _hf_names(task: Any) -> list[str]:
    hf = task.mapping.hf_param
    return [hf] if isinstance(hf, str) else list(hf.values())


@contextlib.contextmanager
def _fp32_target(param: torch.Tensor) -> Iterator[None]:
    """Let the bridge's HF -> Megatron mapping produce fp32 (it casts to the target parameter's dtype)."""
    if param.dtype == torch.float32:
        yield
        return
    original = param.data
    param.data = torch.empty(original.shape, dtype=torch.float32, device=original.device)
    try:
        yield
    finally:
        param.data = original


def _export(tasks: list[Any], local: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full fp32 tensor on the model's device) for every task; ``local(param)`` gives the TP-local
    tensor (collective)."""
    for task in tasks:
        weights = local(task.param_weight) if task.param_weight is not None else None
        for name, tensor in task.mapping.megatron_to_hf(weights, task.megatron_module).items():
            yield name, tensor.detach().float()


def _to_host(tensor: torch.Tensor, buffers: dict[str, Any] | None, path: str) -> torch.Tensor:
    """Host copy of ``tensor``: ``.cpu()`` for a sync save (written before save returns, so it may alias a CPU
    parameter), a copy into the async writer's reused host buffer ``buffers[path]`` otherwise."""
    return tensor.cpu() if buffers is None else snapshot_to_host(tensor, buffers, path)


# ---------------------------------------------------------------------------------------- save
def _collect(
    engine: Any, contents: list[str], rank: int, world: int, buffers: dict[str, Any] | None, key: str
) -> tuple[dict, dict | None]:
    """This rank's share of the DCP state on the host, and the full model on rank 0 when ``hf_model`` is
    saved.

    ``buffers``: the async writer's host buffers (keys under ``key``), None for a sync save."""
    tasks = _tasks(engine)
    slots = _Slots(engine.optimizer) if engine.optimizer is not None else None
    model: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] | None = {} if "hf_model" in contents and rank == 0 else None
    owners: dict[str, int] = {}
    getter = (lambda p: slots.get(p, "param")) if slots is not None else (lambda p: p.detach())
    for i, (name, tensor) in enumerate(_export(tasks, getter)):
        owners[name] = i % world
        if owners[name] == rank or full is not None:
            host = _to_host(tensor, buffers, f"{key}/portable.model.{name}")
            if owners[name] == rank:
                model[name] = host
            if full is not None:
                full[name] = host
    state: dict[str, Any] = {"model": model}
    if "optimizer" in contents:
        optim: dict[str, Any] = {}
        for kind in MOMENTS:
            for name, tensor in _export(tasks, lambda p, k=kind: slots.get(p, k)):
                if owners[name] == rank:
                    optim[f"state.{name}.{kind}"] = _to_host(tensor, buffers, f"{key}/portable.{kind}.{name}")
        step = slots.step()
        group, _ = _template(engine.optimizer_config, engine._lr_step)
        for name in model:
            optim[f"state.{name}.step"] = torch.tensor(float(step))
            optim.update({f"param_groups.{name}.{k}": v for k, v in group.items()})
        state["optimizer"] = optim
    return state, full


def _manifest(engine: Any, contents: list[str], global_step: int, world: int, tied: bool) -> dict:
    cfg = engine.engine_config
    versions = {"torch": torch.__version__}
    for dist_name in ("posttrain-ckpt", "transformers", "megatron-core", "megatron-bridge"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            versions[dist_name] = None
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "global_step": global_step,
        "contents": list(contents),
        "backend": "megatron",
        "layout": LAYOUT,
        "optimizer": "AdamW" if engine.optimizer is not None else None,
        "world_size": world,
        "parallel_sizes": {
            "dp": engine.get_data_parallel_size(),
            "tp": cfg.tensor_model_parallel_size,
            "pp": cfg.pipeline_model_parallel_size,
        },
        "versions": versions,
        "tied_aliases": {"lm_head.weight": "model.embed_tokens.weight"} if tied else {},
        "peft_config": None,
    }


def save(engine: Any, local_path: str, global_step: int, writer: AsyncWriter | None = None) -> Future | None:
    """Write ``checkpoint.save_contents`` of ``engine`` into the role directory ``local_path`` (collective).

    With ``writer`` this returns after the host snapshot with the future of the background write job."""
    contents = list(engine.checkpoint_config.save_contents)
    if "optimizer" in contents and engine.optimizer is None:
        raise ValueError(
            f"checkpoint.save_contents={contents} lists optimizer but this engine is forward_only: "
            "remove optimizer from checkpoint.save_contents"
        )
    _check_supported(engine)
    role = Path(local_path)
    rank, world = _rank_world()
    role.mkdir(parents=True, exist_ok=True)
    buffers = writer.ready_buffers() if writer is not None else None
    state, full = None, None
    if "model" in contents:
        state, full = _collect(engine, contents, rank, world, buffers, role.name)
    extra = None
    if "extra" in contents:
        _, sched = _template(engine.optimizer_config, engine._lr_step)
        extra = capture_extra(None, {"global_step": global_step, "skipped_steps": engine.skipped_steps})
        extra["lr_scheduler"] = sched
    tied = bool(build.unwrap(engine.chunks[0]).share_embeddings_and_output_weights)
    manifest = _manifest(engine, contents, global_step, world, tied)
    info = RoleInfo(model_dir=engine.model_config.path, tokenizer_dir=engine.model_config.tokenizer_dir)
    args = (role, state, extra, full, info, manifest, rank)
    if writer is None:
        write_role_files(*args, None, tie_word_embeddings=tied)
        return None
    return writer.submit(write_role_files, *args, writer.process_group, tie_word_embeddings=tied)


# ---------------------------------------------------------------------------------------- load
def _read(dcp_dir: Path, keys: list[str], metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full tensors of ``keys`` from the DCP checkpoint, read by this rank alone."""
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise ValueError(
            f"{dcp_dir} has no {missing[:3]}: it was not written for this model (HF names differ) or "
            "without the optimizer; check the model path or remove optimizer from checkpoint.load_contents"
        )
    out = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(dcp_dir)), no_dist=True)
    return out


def _load_task(task: Any, read: Any, slots: _Slots | None, kinds: list[str]) -> None:
    """Convert one Megatron parameter's HF tensors (param and moments) and set them (collective over TP).

    ``read(kind, hf names)`` returns the full tensors of those names."""
    hf_param = task.mapping.hf_param
    for kind in kinds:
        if isinstance(hf_param, str):
            hf = read(kind, [hf_param])[hf_param]
        else:
            loaded = read(kind, list(hf_param.values()))
            hf = {part: loaded[name] for part, name in hf_param.items()}
        with _fp32_target(task.param_weight):
            local = task.mapping.hf_to_megatron(hf, task.megatron_module)
        local = local.to(task.param_weight.device, torch.float32)
        if kind == "param":
            with torch.no_grad():
                task.param_weight.copy_(local)
        if slots is not None:
            slots.set(task.param_weight, kind, local)


def _reader(dcp_dir: Path, aliases: dict[str, str]) -> Any:
    """``read(kind, names)``: full tensors of ``model.<name>`` or ``optimizer.state.<name>.<kind>``."""
    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata

    def read(kind: str, names: list[str]) -> dict[str, torch.Tensor]:
        keys = {}
        for name in names:
            stored = aliases.get(name, name)  # a tied name is stored once, under the kept name
            keys[name] = f"model.{stored}" if kind == "param" else f"optimizer.state.{stored}.{kind}"
        loaded = _read(dcp_dir, list(set(keys.values())), metadata)
        return {name: loaded[key] for name, key in keys.items()}

    return read, metadata


def load(engine: Any, local_path: str) -> None:
    """Restore ``checkpoint.load_contents`` from an HF-keyed role directory (collective)."""
    _check_supported(engine)
    role = Path(local_path)
    contents = list(engine.checkpoint_config.load_contents)
    manifest = read_role_manifest(role)
    raise_if(verify_role(role), f"checkpoint {role}")  # every file against its recorded checksums, first
    saved = manifest["contents"]
    missing = [c for c in contents if c not in saved and c != "hf_model"]
    if missing:
        raise ValueError(
            f"checkpoint.load_contents={contents} asks for {missing} but {role} was saved with "
            f"save_contents={saved}: remove {missing} from checkpoint.load_contents"
        )
    with_optim = "optimizer" in contents and engine.optimizer is not None
    dcp_dir = role / DIST_CKPT
    read, metadata = _reader(dcp_dir, manifest.get("tied_aliases") or {})
    slots = _Slots(engine.optimizer) if with_optim else None
    kinds = ["param", *MOMENTS] if with_optim else ["param"]
    if "model" in contents:
        for task in _tasks(engine):
            if task.megatron_module is not None:
                _load_task(task, read, slots, kinds)
    if slots is not None:
        first = next(k for k in metadata if k.startswith("optimizer.state.") and k.endswith(".step"))
        slots.set_step(int(_read(dcp_dir, [first], metadata)[first]))
    if "extra" in contents:
        sched = _SchedulerState()
        counters = load_extra(dcp_dir / EXTRA_DIR, _rank_world()[0], sched)
        engine.skipped_steps = int(counters.get("skipped_steps", engine.skipped_steps))
        if sched.state is not None:
            engine._lr_step = int(sched.state["last_epoch"])
        if engine.optimizer is not None:
            engine._set_lr()
