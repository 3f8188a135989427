"""VLLMRollout: generation on vLLM and the trainer -> vLLM weight sync.

Executors (``rollout.executor``, :class:`~posttrain.rollout_vllm.config.VLLMRolloutConfig`):

- ``external_launcher``: colocated SPMD under torchrun. Every trainer rank builds its own ``LLM`` whose worker
  runs in the rank's process; vLLM's tensor-parallel size is ``rollout.tensor_model_parallel_size`` and its
  data-parallel size ``world_size / tp``, independent of the training layout. Weights reach the local worker
  by reference.
- ``inprocess``: one process, the worker in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); weights by reference.
- ``multiprocess``: one process drives an ``LLM`` whose engine core and workers run in child processes.
- ``server`` (``rollout.executor=server``): an ``AsyncLLM`` whose engine runs in other processes, used for
  async rollout (:meth:`VLLMRollout.agenerate`).

``auto`` picks ``server`` for async mode, ``external_launcher`` under an initialised torch.distributed and
``inprocess`` otherwise. In the last two modes the weight sync passes tensors by reference; otherwise it goes
through POSIX shared memory (CPU) or a CUDA IPC buffer (GPU), see :mod:`posttrain.rollout_vllm.transport`.

A sync (:meth:`VLLMRollout.update_weights`) packs the stream into checksummed buckets; each worker verifies
and loads every bucket in place (:mod:`posttrain.rollout_vllm.extension`), checks that every parameter was
written, and only then is the prefix cache reset (when a request may have filled it since the last reset, see
:meth:`VLLMRollout.prefix_cache_filled`) and generation allowed again. A failed sync leaves the rollout
refusing to generate until a sync succeeds. LoRA: the first sync carries the base weights, later syncs with
``base_sync_done=True`` and a ``peft_config`` carry only the adapter, served as a LoRA request.

Sleep levels follow vLLM: level 1 offloads weights and drops the KV cache, level 2 drops both (a sync must
follow).
:meth:`wake_up` takes ``["weights"]`` and ``["kv_cache"]`` separately, so the weights can be woken and synced
before the KV cache is allocated again. On CPU vLLM has no sleep mode and both are no-ops for memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from posttrain.core.config import ModelConfig
from posttrain.core.dtypes import DTYPES
from posttrain.core.memory_policy import MAX_SEQS
from posttrain.core.rollout import BaseRollout, RolloutConfig, RolloutSample, SamplingConfig, SyncReport
from posttrain.core.weight_sync import BucketSender, WeightSyncError

from .config import VLLMRolloutConfig
from .engine_args import dtype_name, eos_token_ids, max_lora_rank, routed_experts_supported, with_user_kwargs
from .engines import AsyncFront, LLMFront, check_platform, enable_batch_invariance
from .extension import jsonable
from .outputs import samples_of
from .transport import RpcBucketTransport

EXTENSION = "posttrain.rollout_vllm.extension.WeightSyncWorkerExtension"


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class VLLMRollout(BaseRollout):
    """A vLLM engine that generates token ids with log-probs and takes verified weight syncs."""

    def __init__(
        self,
        config: RolloutConfig,
        model: str | ModelConfig,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        *,
        lora_rank: int | None = None,
        deterministic: bool = False,
    ) -> None:
        """``config`` is a :class:`VLLMRolloutConfig` (a plain ``RolloutConfig`` takes its vLLM defaults);
        ``model`` is the HF directory or its :class:`ModelConfig` (the trainer passes ``model``: its
        ``override_config`` reaches vLLM as ``hf_overrides``); a ``lora_rank`` > 0 (there or as keyword)
        starts vLLM with LoRA enabled so adapters sync as adapters. ``dtype`` overrides ``config.dtype``.
        ``deterministic`` (the trainer passes ``actor.engine.full_determinism``) turns on vLLM's
        batch-invariant mode before the engine is built, on a GPU
        (:func:`~posttrain.rollout_vllm.engines.enable_batch_invariance`; on a CPU it warns and stays off)."""
        if not isinstance(model, ModelConfig):
            model = ModelConfig(path=model, trust_remote_code=trust_remote_code)
        if lora_rank is not None:
            model = dataclasses.replace(model, lora_rank=lora_rank)
        self.config, self.model_config = VLLMRolloutConfig.of(config), model
        config = self.config
        self.dtype = dtype_name(dtype if dtype is not None else config.dtype)
        if not model.path or not os.path.isdir(model.path):
            raise ValueError(f"model.path={model.path!r} is not a local HF model directory")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        check_platform(self.device)
        self.executor = self._resolve_executor()
        self.serves_requests = config.serves_requests
        """:meth:`agenerate` works (``posttrain.core.rollout.serves_requests``): with the server executor
        only."""
        self.transport_kind = self._resolve_transport()
        self.sleep_enabled = self.device.type == "cuda" and config.free_cache_engine
        self.eos_ids = eos_token_ids(model.path)
        self.batch_invariant = deterministic and enable_batch_invariance(self.device)
        """vLLM's batch-invariant mode is on for this engine (``VLLM_BATCH_INVARIANT=1``; never on a CPU)."""
        kwargs = self.engine_kwargs()
        self.started_with = kwargs
        """The engine arguments vLLM was started with (``gpu_memory_utilization`` as computed at start)."""
        if self.executor == "server":
            self.engine: LLMFront | AsyncFront = AsyncFront(kwargs)
        else:
            self.engine = LLMFront(kwargs, multiprocess=self.executor == "multiprocess")
        self._transport: RpcBucketTransport | None = None
        self._sender: BucketSender | None = None
        self._asleep: set[str] = set()
        self._weights_error: str | None = None
        self._base_synced = config.load_format != "dummy"
        if not self._base_synced:
            self._weights_error = "the engine started from dummy weights (load_format=dummy)"
        self._lora_request: Any = None
        self._prefix_filled = False
        self.memory_stats: dict[str, float] = {}
        """GiB the last :meth:`sleep` gave back to the device (``sleep_freed_gib``) and its level."""

    @property
    def supports_lora_adapters(self) -> bool:
        """True when LoRA adapters sync unmerged (vLLM started with LoRA); trainers merge them otherwise."""
        return self.model_config.lora_rank > 0

    # ------------------------------------------------------------------ construction
    def _resolve_executor(self) -> str:
        executor = self.config.executor
        if executor == "auto":
            executor = "external_launcher" if _distributed() else "inprocess"
        if executor == "external_launcher" and not _distributed():
            raise ValueError(
                "the external_launcher executor runs under torchrun with torch.distributed "
                "initialised: launch with torchrun or use rollout.executor=inprocess"
            )
        return executor

    def _resolve_transport(self) -> str:
        local = self.executor in ("inprocess", "external_launcher")
        kind = self.config.transport
        if kind == "auto":
            kind = "inprocess" if local else "cuda_ipc" if self.device.type == "cuda" else "shm"
        if kind == "inprocess" and not local:
            raise ValueError(
                f"rollout.transport=inprocess needs the vLLM worker in this process, but rollout.executor="
                f"{self.executor!r} runs it in another: use shm (CPU) or cuda_ipc (GPU)"
            )
        return kind

    def memory_share(self) -> float:
        """vLLM's ``gpu_memory_utilization`` (a share of the whole GPU) for this rollout's budget: an explicit
        ``rollout.gpu_memory_gib``, or ``rollout.gpu_memory_utilization`` of the memory free right now, so a
        trainer built first keeps what it holds. On CPU the configured share is passed through."""
        cfg = self.config
        if self.device.type != "cuda":
            return cfg.gpu_memory_utilization
        free, total = torch.cuda.mem_get_info(self.device)
        want = cfg.gpu_memory_gib * 2**30 if cfg.gpu_memory_gib else cfg.gpu_memory_utilization * free
        if want > free:
            raise ValueError(
                f"rollout.gpu_memory_gib={cfg.gpu_memory_gib} asks for more than the {free / 2**30:.1f} GiB "
                f"free on {self.device}: lower it, or set it to 0 to take rollout.gpu_memory_utilization "
                "of the free memory"
            )
        return want / total

    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of vLLM's ``LLM`` / ``AsyncEngineArgs`` for this config."""
        cfg = self.config
        eager = cfg.enforce_eager if cfg.enforce_eager is not None else self.device.type != "cuda"
        max_seqs = cfg.max_num_seqs if cfg.max_num_seqs is not None else MAX_SEQS
        kwargs: dict[str, Any] = dict(
            model=self.model_config.path,
            dtype=self.dtype,
            tensor_parallel_size=cfg.tensor_model_parallel_size,
            gpu_memory_utilization=self.memory_share(),
            enforce_eager=eager,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=max_seqs,
            max_model_len=cfg.max_model_len or cfg.prompt_length + cfg.response_length,
            enable_prefix_caching=cfg.enable_prefix_caching,
            load_format=cfg.load_format,
            seed=cfg.seed,
            skip_tokenizer_init=True,
            trust_remote_code=self.model_config.trust_remote_code,
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_enabled,
        )
        if not eager and max_seqs > 512:  # vLLM captures decode graphs up to 512 sequences unless told more
            kwargs.update(compilation_config={"max_cudagraph_capture_size": max_seqs})
        if self.model_config.override_config:  # the fields the trainer's engine sets on the HF config
            kwargs.update(hf_overrides=dict(self.model_config.override_config))
        if self.model_config.lora_rank > 0:
            kwargs.update(
                enable_lora=True, max_lora_rank=max_lora_rank(self.model_config.lora_rank), max_loras=1
            )
        if cfg.return_routed_experts:
            kwargs.update(enable_return_routed_experts=routed_experts_supported())
        if self.executor == "external_launcher":
            world = torch.distributed.get_world_size()
            if world % cfg.tensor_model_parallel_size:
                raise ValueError(
                    f"rollout.tensor_model_parallel_size={cfg.tensor_model_parallel_size} does not "
                    f"divide the torchrun world size {world}: choose a divisor of {world}"
                )
            kwargs.update(
                distributed_executor_backend="external_launcher",
                data_parallel_size=world // cfg.tensor_model_parallel_size,
            )
        return with_user_kwargs(kwargs, cfg.engine_kwargs)

    # ------------------------------------------------------------------ generation
    def sampling_params(self, sampling: SamplingConfig) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: one output per request holding all n samples (the async engine otherwise streams them).
        # The trainer reads token ids and the sampled tokens' log-probs only: no detokenizing (vLLM would
        # decode every token of every sample on the host), and the log-probs as one flat list per sample
        # instead of a {token: Logprob} dict per token.
        return SamplingParams(
            detokenize=False,
            flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=sorted(set(sampling.stop_token_ids) | set(self.eos_ids)),
            seed=sampling.seed,
            logprobs=0,
        )

    def _check_ready(self) -> None:
        if self._weights_error is not None:
            raise WeightSyncError(
                f"the rollout has no valid weights: {self._weights_error}; call update_weights "
                "with the full model before generating"
            )
        if self._asleep:
            self.wake_up()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[RolloutSample]:
        self._check_ready()
        params: Any = self.sampling_params(sampling)
        if sampling.seed is not None:  # vLLM seeds each request: equal prompts would sample equal tokens
            params = [
                self.sampling_params(dataclasses.replace(sampling, seed=sampling.prompt_seed(i)))
                for i in range(len(prompts))
            ]
        with self._filling_prefix_cache():
            outputs = self.engine.generate(prompts, params, self._lora_request)
        return [s for i, out in enumerate(outputs) for s in samples_of(i, out)]

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, prompt_index: int = 0
    ) -> list[RolloutSample]:
        """One prompt's ``sampling.n`` samples, awaitable from any event loop (server executor only)."""
        if not isinstance(self.engine, AsyncFront):
            raise ValueError(f"agenerate needs rollout.executor=server, not {self.executor!r}")
        self._check_ready()
        with self._filling_prefix_cache():
            out = await self.engine.submit(prompt_ids, self.sampling_params(sampling), self._lora_request)
        return samples_of(prompt_index, out)

    @contextlib.contextmanager
    def _filling_prefix_cache(self):
        """Marks the prefix cache filled when requests go in and again when they are done: a request held back
        while a server-executor sync ran (:meth:`AsyncFront.paused`) fills the cache after that sync's
        reset."""
        self._prefix_filled = True
        try:
            yield
        finally:
            self._prefix_filled = True

    # ------------------------------------------------------------------ weight sync
    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        peft_config: dict[str, Any] | None = None,
        base_sync_done: bool = False,
        version: int | None = None,
    ) -> SyncReport:
        """Sync the base weights, or (``peft_config`` and ``base_sync_done``) the LoRA adapter only; the
        workers serve ``version`` once the sync is complete (:meth:`weight_version`)."""
        kind = "lora" if peft_config is not None and base_sync_done else "base"
        if kind == "lora" and not self._base_synced:
            raise ValueError(
                "a LoRA adapter sync (base_sync_done=True) came before any base sync: call "
                "update_weights(base weights, base_sync_done=False) first"
            )
        if kind == "lora" and self.model_config.lora_rank <= 0:
            raise ValueError("a LoRA adapter sync needs model.lora_rank > 0 so vLLM starts with LoRA enabled")
        if "weights" in self._asleep:
            self.wake_up(["weights"])
        pause = self.engine.paused() if isinstance(self.engine, AsyncFront) else contextlib.nullcontext()
        with pause:
            return self._sync(kind, weights, peft_config, version)

    def weight_version(self) -> int | None:
        """The version every worker serves (asked of the workers), None unless they all finished one sync."""
        if self._weights_error is not None:
            return None
        versions = set(self.engine.collective_rpc("ws_version"))
        return versions.pop() if len(versions) == 1 else None

    def _sync(
        self,
        kind: str,
        weights: Iterable[tuple[str, torch.Tensor]],
        peft_config: dict[str, Any] | None,
        version: int | None,
    ) -> SyncReport:
        start = time.perf_counter()
        sender = self.sender
        lora = (self.config.lora_name, self.config.lora_int_id) if kind == "lora" else None
        try:
            self.engine.collective_rpc("ws_begin", kind, jsonable(peft_config), lora)
            report = sender.send(weights)
            results = self.engine.collective_rpc("ws_finish")
        except Exception as exc:
            self._weights_error = f"the last weight sync failed ({type(exc).__name__}: {exc})"
            try:
                self.engine.collective_rpc("ws_abort")
            except Exception as abort_exc:  # the engine may be gone; the sync's own error is the one to raise
                exc.add_note(f"aborting the sync on the vLLM workers failed too: {abort_exc}")
            if isinstance(exc, (WeightSyncError, ValueError)):
                raise
            raise WeightSyncError(f"weight sync failed on the vLLM side: {exc}") from exc
        bad = [r["num_tensors"] for r in results if r["num_tensors"] != report.num_tensors]
        if bad:
            self._weights_error = "a worker loaded a different number of tensors than were sent"
            raise WeightSyncError(f"sent {report.num_tensors} tensors but workers loaded {bad}")
        loaded = time.perf_counter()
        if self.prefix_cache_filled:
            self._reset_after_sync()
            report.timings["prefix_reset_s"] = time.perf_counter() - loaded
        if kind == "lora":
            from vllm.lora.request import LoRARequest

            self._lora_request = LoRARequest(*lora, results[0]["lora_path"])
        else:
            self._base_synced, self._lora_request = True, None
        self.engine.collective_rpc("ws_commit", version)
        self._weights_error = None
        report.timings.update(
            send_s=report.seconds,
            worker_load_s=max(r["load_s"] for r in results),
            finish_s=loaded - start - report.seconds,
        )
        report.seconds = time.perf_counter() - start
        return report

    @property
    def prefix_cache_filled(self) -> bool:
        """True when vLLM's prefix cache may hold blocks computed since its last reset: a request was
        submitted since a sync's reset or a sleep. Only then does a sync reset the cache."""
        return self.config.enable_prefix_caching and self._prefix_filled

    def _reset_after_sync(self) -> None:
        if not self.reset_prefix_cache():
            self._weights_error = "the prefix cache could not be reset after the sync"
            raise WeightSyncError(
                "vLLM refused to reset its prefix cache after the sync (requests still running?): "
                "cached KV blocks would be served from the old weights"
            )

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's prefix-cache entries now; False if vLLM refuses (requests running). A sync calls it
        after new weights are in, only when entries can exist (:attr:`prefix_cache_filled`): vLLM's reset
        walks every KV block in Python (22 ms of a profiled 1.5B sync: 83,688 blocks in 0.3 of an H200).
        Entries come only from scheduled requests, so with the cache off, or when nothing was submitted since
        the last reset, no block carries a hash that could serve keys and values of the old weights. vLLM's
        ``sleep`` (levels 1 and 2) resets the cache itself (``EngineCore.sleep`` ->
        ``pause_scheduler(clear_cache=True)`` in vLLM 0.26 and 0.33), so in the trainer's cycle (generate,
        sleep, train, wake the weights, sync) the sync has nothing to reset."""
        if not self.engine.reset_prefix_cache():
            return False
        self._prefix_filled = False
        return True

    @property
    def transport(self) -> RpcBucketTransport:
        """The weight-sync transport (its buffer is allocated on first use and kept until :meth:`release`)."""
        if self._transport is None:
            bucket = self.config.update_weights_bucket_megabytes << 20
            device = self.device if self.transport_kind != "shm" else torch.device("cpu")
            self._transport = RpcBucketTransport(
                self.transport_kind,
                bucket,
                device,
                lambda payload: self.engine.collective_rpc("ws_load_bucket", payload),
            )
        return self._transport

    @property
    def sender(self) -> BucketSender:
        """The bucket sender over :attr:`transport`, kept with it: a sync packs the layout of the last one
        into the buffer views it already holds."""
        if self._sender is None:
            transport = self.transport
            self._sender = BucketSender(
                transport, transport.buffer.numel(), dtype=DTYPES[self.dtype], buffer=transport.buffer
            )
        return self._sender

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: use 1 (offload weights) or 2 (discard weights)")
        if self.sleep_enabled:
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.engine.sleep(level)
            self.memory_stats["sleep_freed_gib"] = (
                torch.cuda.mem_get_info(self.device)[0] - free_before
            ) / 2**30
            self.memory_stats["sleep_level"] = level
            self._prefix_filled = False  # vLLM's sleep reset the prefix cache (see reset_prefix_cache)
        self._asleep = {"weights", "kv_cache"}
        if level == 2:
            self._weights_error = "sleep(level=2) discarded the weights"

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = list(tags) if tags is not None else ["weights", "kv_cache"]
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} are unknown: use weights and/or kv_cache")
        todo = [t for t in tags if t in self._asleep]
        if todo and self.sleep_enabled:
            # a colocated trainer's freed activations stay cached in torch's allocator, and vLLM maps its
            # pools outside it: hand them back first (vLLM 0.33's CuMemAllocator.wake_up does so, 0.26's not)
            torch.cuda.empty_cache()
            self.engine.wake_up(todo)
        self._asleep -= set(todo)

    def release(self) -> None:
        """Free the bucket buffer, remove the workers' LoRA adapter directories and shut vLLM down."""
        self._sender = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self.engine is not None:
            engine, self.engine = self.engine, None
            try:
                engine.collective_rpc("ws_close")  # the workers' LoRA adapter directories (in /dev/shm)
            finally:
                engine.shutdown()
