"""HFRollout: batched generation with a transformers causal LM, the CPU default rollout.

Generation runs the HF model's own forward in a decode loop (:mod:`posttrain.rollout_hf.decode`) rather than
``model.generate``, so that sampling draws from a ``torch.Generator`` (reproducible from
``SamplingConfig.seed`` or the rollout seed without touching the global RNG) and the reported log-probs are
exactly those of
:mod:`posttrain.rollout_hf.sampling`. Prompts are repeated ``n`` times (prompt 0's samples first), left-padded
into one batch with positions that start at 0 on each prompt's first real token, prefilled once into a static
KV cache, then decoded one token per step until every row has produced a stop token (eos always counts) or
``max_new_tokens`` tokens; the loop stays on the device (no host sync per token). :meth:`HFRollout.agenerate`
serves one prompt per request (the agent loop's ``agent.loop=async`` and ``trainer.mode=stream``) through the
same path, one request at a time. The HF rollout's own keys
(:class:`~posttrain.rollout_hf.config.HFRolloutConfig`: ``rollout.cache``, ``rollout.compile``...) set the
cache kind and the ``torch.compile`` of the decode step. With
``rollout.return_routed_experts`` (MoE models) each sample also carries the experts every MoE layer chose for
its tokens (:mod:`posttrain.rollout_hf.routing`).

Weights arrive through engine-core's bucketed protocol even though trainer and rollout share a process:
``BucketSender -> InProcessTransport -> BucketReceiver`` checksums every tensor, and the receiver copies each
one into the HF parameter or buffer of the same name under ``no_grad`` (a per-expert MoE name into its slice
of transformers' fused expert parameter, :mod:`posttrain.rollout_hf.experts`). An unknown name, a shape
mismatch, or a sync that leaves a parameter untouched (tied weights count once) raises ``WeightSyncError``,
and until a sync completes the rollout refuses to generate. A LoRA actor may stream merged weights, or
(verl's ``base_sync_done`` protocol) the base weights once and then only its adapters, which
:mod:`posttrain.rollout_hf.lora` merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from posttrain.core import BaseRollout, RolloutConfig, RolloutSample, SamplingConfig, SyncReport
from posttrain.core.config import ModelConfig
from posttrain.core.determinism import enable_deterministic_kernels
from posttrain.core.dtypes import parse_dtype
from posttrain.core.weight_sync import (
    BucketReceiver,
    BucketSender,
    BucketTransport,
    InProcessTransport,
    WeightSyncError,
)

from .attention import register as register_attention
from .config import HFRolloutConfig
from .decode import Decoder
from .experts import expert_slot
from .lora import AdapterMerger, check_peft_config
from .routing import RoutingRecorder


def eos_token_ids(model: Any) -> set[int]:
    """The model's eos token id(s) from its generation config, else its model config."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


def load_model(spec: ModelConfig, dtype: torch.dtype, dummy: bool) -> Any:
    """The causal LM of ``spec.path`` on the CPU, its HF config with ``spec.override_config`` applied (as the
    trainer's engine applies it): its weights, or (``dummy``) random ones; sdpa attention is swapped for the
    masked one-token kernel of :mod:`.attention`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = spec.trust_remote_code
    hf_config = AutoConfig.from_pretrained(spec.path, trust_remote_code=remote)
    for key, value in spec.override_config.items():
        setattr(hf_config, key, value)
    if dummy:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=remote)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            spec.path, config=hf_config, dtype=dtype, trust_remote_code=remote
        )
    if model.config._attn_implementation == "sdpa":  # same kernels, no per-head cache copy
        model.set_attn_implementation(register_attention())
    return model


class HFRollout(BaseRollout):
    """A transformers causal LM that generates in batches and takes new weights through bucketed sync."""

    def __init__(
        self,
        config: RolloutConfig,
        model: str | ModelConfig,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        *,
        deterministic: bool = False,
    ) -> None:
        """``config`` is an :class:`HFRolloutConfig` (a plain ``RolloutConfig`` takes its HF defaults);
        ``model`` is the HF directory (with ``trust_remote_code``) or the trainer's :class:`ModelConfig` (its
        path, ``trust_remote_code`` and ``override_config``);
        ``deterministic`` (the trainer passes ``actor.engine.full_determinism``) turns on torch's
        deterministic kernels (:func:`~posttrain.core.determinism.enable_deterministic_kernels`).
        ``load_format=dummy`` builds the model from its config with random weights and refuses to generate
        before the first full sync."""
        self.config = config = HFRolloutConfig.of(config)
        if deterministic:
            enable_deterministic_kernels()
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype if dtype is not None else config.dtype, "rollout.dtype")
        if not isinstance(model, ModelConfig):
            model = ModelConfig(path=model, trust_remote_code=trust_remote_code)
        self.model = load_model(model, self.dtype, config.load_format == "dummy")
        self.model.to(self.device).eval()
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.eos_ids = eos_token_ids(self.model)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self._decoder = Decoder(config, self.pad_token_id)
        self._weights_error: str | None = None
        self._base_loaded = config.load_format != "dummy"
        if not self._base_loaded:
            self._weights_error = "it started from random weights (rollout.load_format=dummy)"
        self._asleep = False
        self._synced: set[int] = set()
        self._pieces: dict[int, int] = {}
        """Tensors received per parameter in this sync (a fused expert parameter takes one per expert)."""
        self._adapters = AdapterMerger()
        self._lock = threading.Lock()
        """Held by every decode: one model decodes one batch at a time, whichever thread calls."""
        self._requests: ThreadPoolExecutor | None = None
        """The thread :meth:`agenerate` decodes on (started by the first request)."""

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[RolloutSample]:
        """``sampling.n`` samples per prompt, prompt 0's first; see the module docstring for the log-probs."""
        with self._lock:
            return self._generate(prompts, sampling)

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, prompt_index: int = 0
    ) -> list[RolloutSample]:
        """One prompt's ``sampling.n`` samples, awaitable from any event loop (``agent.loop=async``,
        ``trainer.mode=stream``): :meth:`generate` over ``[prompt_ids]`` on the rollout's request thread, with
        ``prompt_index`` set. Requests are serialized: one decodes at a time, in the order they came, with no
        batching across episodes (one HF model decodes one batch at a time), so a request's samples equal
        those of ``generate`` for the same prompt, seed and sampling. The request thread takes the torch
        intra-op thread count of the thread that made the first request."""
        if self._requests is None:
            threads = torch.get_num_threads()
            self._requests = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="posttrain-hf-request",
                initializer=lambda: torch.set_num_threads(threads),
            )
        loop = asyncio.get_running_loop()
        samples = await loop.run_in_executor(self._requests, self.generate, [list(prompt_ids)], sampling)
        return [dataclasses.replace(s, prompt_index=prompt_index) for s in samples]

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[RolloutSample]:
        if self._weights_error is not None:
            raise RuntimeError(
                f"the HF rollout has no valid weights: {self._weights_error}; run update_weights with every "
                "weight before generating"
            )
        if self.model is None:
            raise RuntimeError("the HF rollout was released: build a new one")
        if self._asleep:
            raise RuntimeError("the HF rollout is asleep: call wake_up() before generate()")
        if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt and every prompt needs at least one token")
        limit = self.config.max_model_len or self.config.prompt_length + self.config.response_length
        longest = max(len(p) for p in prompts)
        if longest + sampling.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={sampling.max_new_tokens} exceeds the "
                f"rollout's context of {limit} tokens: raise rollout.max_model_len (or "
                "prompt_length/response_length) or filter long prompts"
            )
        generator = self.generator
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed)
        rows = [list(p) for p in prompts for _ in range(sampling.n)]
        routing = None
        if self.config.return_routed_experts:
            routing = RoutingRecorder(self.model, len(rows), sampling.max_new_tokens)
        stop_ids = sorted(self.eos_ids | set(sampling.stop_token_ids))
        width = limit - sampling.max_new_tokens if self.config.compile else None  # one shape for every call
        with torch.no_grad(), routing or contextlib.nullcontext():
            out = self._decoder.run(self.model, rows, sampling, generator, stop_ids, routing, width=width)
        return [
            RolloutSample(
                prompt_index=i // sampling.n,
                prompt_ids=rows[i],
                response_ids=out.tokens[i, : out.lengths[i]].tolist(),
                log_probs=out.log_probs[i, : out.lengths[i]].clone(),
                finish_reason="stop" if out.stopped[i] else "length",
                routed_experts=routing.sample(i, len(rows[i]), out.lengths[i]) if routing else None,
            )
            for i in range(len(rows))
        ]

    # ------------------------------------------------------------------ weights
    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """Every HF state-dict name (tied weights appear under each of their names)."""
        return dict(self.model.state_dict(keep_vars=True))

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        targets = self._named_tensors()
        with torch.no_grad():
            for name, tensor in tensors:
                whole, target, pieces = self._resolve(name, targets)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise WeightSyncError(
                        f"weight sync sent {name!r} with shape {tuple(tensor.shape)}, the rollout "
                        f"model has {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                self._pieces[id(whole)] = self._pieces.get(id(whole), 0) + 1
                if self._pieces[id(whole)] == pieces:
                    self._synced.add(id(whole))

    def _resolve(self, name: str, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(parameter, the view of it that ``name`` fills, tensors that fill the parameter): the parameter of
        that name, or for a per-expert name its slice of the fused experts (:mod:`.experts`)."""
        if name in targets:
            return targets[name], targets[name], 1
        slot = expert_slot(name, targets)
        if slot is None:
            raise WeightSyncError(
                f"weight sync sent {name!r}, which the HF rollout model does not have "
                f"(it has e.g. {sorted(targets)[:3]}): trainer and rollout models differ"
            )
        return slot

    def _check_complete(self) -> None:
        """Raise unless every parameter (tied ones count once) received a tensor in this sync."""
        missing = [name for name, p in self.model.named_parameters() if id(p) not in self._synced]
        if missing:
            raise WeightSyncError(
                f"weight sync left {len(missing)} parameter(s) of the HF rollout untouched, e.g. "
                f"{missing[:3]}: stream every weight (a full sync), or the rollout would generate from stale "
                "weights"
            )

    def _make_transport(self, receiver: BucketReceiver) -> BucketTransport:
        """How buckets reach the receiver: in-process here."""
        return InProcessTransport(receiver)

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        peft_config: dict[str, Any] | None = None,
        base_sync_done: bool = False,
        version: int | None = None,
    ) -> SyncReport:
        """Load a stream through checksummed buckets; returns what moved (``version`` is served once it all
        loaded). Without ``peft_config`` (or with it
        and ``base_sync_done=False``, LoRA's base weights) the stream is every weight under HF names; with
        ``peft_config`` and ``base_sync_done=True`` it is the LoRA adapter only, merged by :mod:`.lora`."""
        with self._lock:  # never under a decode
            return self._update_weights(weights, peft_config, base_sync_done, version)

    def _update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        peft_config: dict[str, Any] | None,
        base_sync_done: bool,
        version: int | None,
    ) -> SyncReport:
        if self._asleep:
            raise RuntimeError("the HF rollout is asleep: call wake_up(['weights']) before update_weights()")
        adapter_only = peft_config is not None and base_sync_done
        if adapter_only and not self._base_loaded:
            raise ValueError(
                "a LoRA adapter sync (base_sync_done=True) came before any base weights (rollout.load_format="
                "dummy): call update_weights(every weight, base_sync_done=False) first"
            )
        if peft_config is not None:
            check_peft_config(peft_config)
        start = time.perf_counter()
        receiver = BucketReceiver(self._adapters.collect if adapter_only else self._load)
        sender = BucketSender(
            self._make_transport(receiver),
            self.config.update_weights_bucket_megabytes << 20,
            device=self.device,
            dtype=self.dtype,
        )
        self._weights_error = "the last weight sync failed and left them partly updated"
        self._weight_version = None
        self._synced = set()
        self._pieces = {}
        report = sender.send(weights)
        loaded = receiver.finish()
        if loaded != report.num_tensors:
            raise WeightSyncError(
                f"weight sync sent {report.num_tensors} tensors but the rollout loaded {loaded}"
            )
        if adapter_only:
            self._adapters.merge(self._named_tensors(), peft_config)
        else:
            self._check_complete()
            self._adapters.reset_bases()
            self._base_loaded = True
        self._weights_error, self._weight_version = None, version
        report.timings["update_weights"] = time.perf_counter() - start
        return report

    # ------------------------------------------------------------------ memory and state
    def sleep(self, level: int = 1) -> None:
        """Offload the weights to CPU memory (on CPU there is nothing to free); the KV cache lives only inside
        ``generate``. Level 2 does the same (the weights are kept, not discarded). Until :meth:`wake_up`
        brings the weights back, ``generate`` and ``update_weights`` refuse to run, on CPU too."""
        self._decoder.reset()
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring the weights back to the device (``kv_cache`` needs nothing: it is built per call)."""
        tags = list(tags) if tags is not None else ["weights", "kv_cache"]
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} are unknown: use 'weights' and/or 'kv_cache'")
        if "weights" in tags:
            self.model.to(self.device)
            self._asleep = False

    def release(self) -> None:
        """Drop the model (after the decode in progress); the rollout cannot be used afterwards."""
        if self._requests is not None:
            self._requests.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._decoder.reset()
            self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state, so a resumed run draws the same samples."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
