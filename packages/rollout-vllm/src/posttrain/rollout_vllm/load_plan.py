"""vLLM's ``load_weights`` recorded once, then replayed as one batched copy per bucket.

A direct sync (see :mod:`.extension`) hands every tensor to vLLM's ``model.load_weights``. For a dense model
that call does little device work (a copy into a slice of a fused parameter) and much host work: vLLM's
``AutoWeightsLoader`` walks the module tree per tensor, maps the name, finds the parameter and calls its
weight loader, about 50 microseconds a tensor. At 338 tensors that is most of a 1.5B model's worker time.

The first direct sync loads each tensor through ``load_weights`` alone, under a ``TorchDispatchMode``
(:class:`LoadRecorder`) that sees every aten op the call runs. A tensor whose load was only views of the
tensor and ``copy_`` from those views into views of the model's parameters gets a :class:`TensorPlan`: the
(parameter view, source view) pairs in the geometry the loader used, and the parameter names ``load_weights``
reported. From the next sync on (:meth:`LoadPlan.replay`) a bucket's planned tensors are written with one
``torch._foreach_copy_``, and only the rest go through ``load_weights``.

A tensor gets no plan, and keeps going through ``load_weights``, when its load did anything else:

- an op other than a view read the tensor (a cast, a transpose made contiguous, arithmetic);
- a parameter was written other than by a same-shape, same-dtype ``copy_`` from a view of the tensor
  (a ``fill_`` of padding rows, a copy from a temporary);
- a write it made overlaps a write of another tensor (then the order of the writes would matter).

A plan holds for the parameters it was recorded against: every sync first checks that the model still has the
same parameter objects at the same addresses (:meth:`LoadPlan.valid`); if not, the plan is dropped and the
sync records a new one. Python-side state a loader might set is not replayed; this is why the plan is only
used where the direct load is (a dense, unquantised model on CUDA, whose layers do nothing after loading).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LoadPlan", "LoadRecorder", "TensorPlan"]


@dataclass(frozen=True)
class Copy:
    """One recorded ``copy_``: the destination as a view of a parameter, the source as a view of the
    tensor."""

    param: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int
    """Elements from the loaded tensor's own storage offset."""


@dataclass
class TensorPlan:
    """How one tensor (under its stream name) is loaded, or why it is not planned."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    loaded: frozenset[str]
    copies: list[Copy] = field(default_factory=list)
    writes: list[tuple[int, int, int]] = field(default_factory=list)
    """(storage address, first byte, end byte) of everything the load wrote into a parameter."""
    refused: str | None = None
    """Why this tensor has no plan (None: it has one)."""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` a strided tensor spans, from its first element."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten op writes, from its schema's alias annotations."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.extend(v for v in tree_leaves(value) if isinstance(v, torch.Tensor))
    return out


class LoadRecorder(TorchDispatchMode):
    """Watches the aten ops of loading one tensor (``source``) into a model whose parameters' storages are
    ``params`` (storage address -> parameter name); :meth:`plan` says what it saw."""

    def __init__(self, source: torch.Tensor, params: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.source, self.params = source, params
        self.range = _extent(source)
        self.copies: list[Copy] = []
        self.writes: list[tuple[int, int, int]] = []
        self.refused: str | None = None

    def _reads_source(self, t: torch.Tensor) -> bool:
        start, end = _extent(t)
        return start < self.range[1] and self.range[0] < end and start != end

    def _param_of(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return self.params.get(t.untyped_storage().data_ptr())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is None:
            self._watch(func, args, kwargs)
        return out

    def _watch(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func.is_view:
            return
        into_params = [t for t in _written(func, args, kwargs) if self._param_of(t) is not None]
        self.writes.extend((t.untyped_storage().data_ptr(), *_extent(t)) for t in into_params)
        if func is torch.ops.aten.copy_.default and self._copy(*args[:2]):
            return
        if into_params:
            self.refused = f"{func} wrote a parameter"
        elif any(self._reads_source(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            self.refused = f"{func} read the tensor"

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Record ``dst.copy_(src)`` if it is a plain copy from the tensor into a parameter."""
        owner = self._param_of(dst)
        if owner is None or not self._reads_source(src):
            return False
        name, param = owner
        if dst.shape != src.shape or dst.dtype != src.dtype or dst.dtype != param.dtype:
            return False
        same_storage = src.untyped_storage().data_ptr() == self.source.untyped_storage().data_ptr()
        if src.dtype != self.source.dtype or not same_storage:
            return False
        self.copies.append(
            Copy(
                name,
                tuple(dst.shape),
                tuple(dst.stride()),
                dst.storage_offset(),
                tuple(src.shape),
                tuple(src.stride()),
                src.storage_offset() - self.source.storage_offset(),
            )
        )
        return True

    def plan(self, loaded: Iterable[str]) -> TensorPlan:
        refused = self.refused or (None if self.copies else "the load copied nothing from the tensor")
        return TensorPlan(
            tuple(self.source.shape), self.source.dtype, frozenset(loaded), self.copies, self.writes, refused
        )


def _overlapping(plans: dict[str, TensorPlan]) -> set[str]:
    """Names whose parameter writes overlap another name's."""
    spans = sorted(
        (storage, start, end, name) for name, p in plans.items() for storage, start, end in p.writes
    )
    out: set[str] = set()
    reach: tuple[int, int, str] | None = None  # (storage, furthest end so far, its name)
    for storage, start, end, name in spans:
        if reach is not None and reach[0] == storage and start < reach[1] and reach[2] != name:
            out.update((name, reach[2]))
        if reach is None or reach[0] != storage or end > reach[1]:
            reach = (storage, end, name)
    return out


class LoadPlan:
    """The recorded plans of one model; :meth:`record` during the first sync, :meth:`replay` after it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = self._named(model)
        self.by_storage = {p.untyped_storage().data_ptr(): (n, p.data) for n, p in self.params.items()}
        self.addresses = {n: p.data_ptr() for n, p in self.params.items()}
        self.plans: dict[str, TensorPlan] = {}
        self.views: dict[str, list[torch.Tensor]] = {}
        self.ready = False

    @staticmethod
    def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {**dict(model.named_buffers()), **dict(model.named_parameters())}

    def record(
        self, load: Callable[[list[tuple[str, torch.Tensor]]], Iterable[str] | None], tensors
    ) -> set[str]:
        """Load each of ``tensors`` alone through ``load`` (vLLM's ``load_weights`` on a list) while recording
        it; returns the parameter names reported loaded."""
        loaded: set[str] = set()
        for name, tensor in tensors:
            recorder = LoadRecorder(tensor, self.by_storage)
            with recorder:
                names = set(load([(name, tensor)]) or ())
            self.plans[name] = recorder.plan(names)
            loaded |= names
        return loaded

    def finish(self) -> dict[str, int]:
        """After a whole recorded sync: refuse overlapping writes, build the parameter views; returns
        counts."""
        for name in _overlapping(self.plans):
            self.plans[name].refused = "its writes overlap another tensor's"
        for name, plan in self.plans.items():
            if plan.refused is None:
                self.views[name] = [
                    self.params[c.param].data.as_strided(c.size, c.stride, c.offset) for c in plan.copies
                ]
        self.ready = True
        planned = len(self.views)
        return {"planned": planned, "unplanned": len(self.plans) - planned}

    def refusals(self) -> dict[str, str]:
        """Name -> why it has no plan."""
        return {n: p.refused for n, p in self.plans.items() if p.refused is not None}

    def valid(self, model: torch.nn.Module) -> bool:
        """The model still holds the parameters the plan writes, as the same objects at the same addresses."""
        now = self._named(model)
        used = {c.param for p in self.plans.values() if p.refused is None for c in p.copies}
        return all(now.get(n) is self.params[n] and now[n].data_ptr() == self.addresses[n] for n in used)

    def replay(
        self, tensors: list[tuple[str, torch.Tensor]]
    ) -> tuple[set[str], list[tuple[str, torch.Tensor]]]:
        """Write the planned tensors (one ``_foreach_copy_``); returns (the parameter names they load, the
        tensors with no plan, for ``load_weights``)."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        loaded: set[str] = set()
        rest = []
        for name, tensor in tensors:
            plan = self.plans.get(name)
            if name not in self.views or plan.shape != tuple(tensor.shape) or plan.dtype != tensor.dtype:
                rest.append((name, tensor))
                continue
            base = tensor.storage_offset()
            for copy, view in zip(plan.copies, self.views[name]):
                whole = (
                    copy.src_offset == 0
                    and copy.src_size == plan.shape
                    and copy.src_stride == tensor.stride()
                )
                srcs.append(
                    tensor
                    if whole
                    else tensor.as_strided(copy.src_size, copy.src_stride, base + copy.src_offset)
                )
                dsts.append(view)
            loaded |= plan.loaded
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return loaded, rest
