"""Background writer for async checkpoint saves.

One worker thread runs write jobs strictly in submission order: every role's DCP write, then the step's
commit.
Jobs that need collectives (DCP planning, the commit barriers) use ``process_group``, a gloo group created
only for the writer, so they never interleave with the training collectives on the default group. After a job
fails, later jobs are skipped (a commit must never follow a failed write) and :meth:`wait` raises the first
error.

:meth:`AsyncWriter.prepare` allocates the host buffers of a future snapshot on a second thread (pinning host
memory for CUDA state takes seconds per GB-scale tensor set), so the first async save finds them ready;
:meth:`AsyncWriter.ready_buffers` waits for that allocation and merges it into ``host_buffers``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from .snapshot import allocate_buffers, buffer_plan


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write or commit failed."""


class AsyncWriter:
    """Runs checkpoint write jobs on one background thread, in order."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-ckpt-writer")
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.host_buffers: dict[str, Any] = {}
        """Host copies reused by successive snapshots (keyed by role and tensor name)."""
        self._preparing: list[Future] = []

    def prepare(self, state: Any, prefix: str) -> Future:
        """Start allocating, on a background thread, the host buffers a snapshot of ``state`` under ``prefix``
        will use (``state``: nested dicts/lists of tensors and DTensors; only shapes, dtypes and devices are
        read here, nothing is copied). The next snapshot waits for it (:meth:`ready_buffers`) and reuses the
        buffers whose shape and dtype still match. Returns the allocation's future (its result: the buffers by
        key path).
        """
        plan = buffer_plan(state, prefix)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-ckpt-prepare")
        future = executor.submit(allocate_buffers, plan)
        executor.shutdown(wait=False)
        self._preparing.append(future)
        return future

    def ready_buffers(self) -> dict[str, Any]:
        """Wait for every :meth:`prepare` started so far, add its buffers to ``host_buffers``, return that."""
        preparing, self._preparing = self._preparing, []
        for future in preparing:
            self.host_buffers.update(future.result())
        return self.host_buffers

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)`` after every job submitted before it."""

        def job() -> Any:
            with self._lock:
                if self._error is not None:
                    raise CheckpointWriteError(
                        f"skipped {getattr(fn, '__name__', fn)}: an earlier checkpoint write failed"
                    ) from self._error
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                with self._lock:
                    self._error = self._error or exc
                raise

        future = self._executor.submit(job)
        self._futures.append(future)
        return future

    @property
    def busy(self) -> bool:
        """True while a job is queued or running."""
        return any(not f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every queued job has finished; raise if any failed (the error is then cleared)."""
        futures, self._futures = self._futures, []
        for f in futures:
            f.exception()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointWriteError(f"async checkpoint save failed: {error!r}") from error

    def close(self) -> None:
        """Wait for the queued jobs, then stop the thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
