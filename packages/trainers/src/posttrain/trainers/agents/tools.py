"""Run the tool calls of a turn: each on a worker thread with a timeout, every failure an error message.

A call to a name the environment does not list (``unknown_tool``), a call whose function raises (``raised``,
wrong arguments included) and one that does not return within ``timeout_s`` of its submission (``timeout``)
each become a tool message the model reads (``error: ...``) and a counted failure kind; malformed calls come
from the parser (``malformed``). A timed-out call keeps its worker thread until it returns (Python cannot stop
a thread); its result is discarded. A result longer than ``max_tokens`` tokens is cut to that many and marked
``[truncated]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from posttrain.core.env import ToolCall, ToolResult

from .codec import Codec

TRUNCATED = " ...[truncated]"
ERROR_KINDS = ("malformed", "unknown_tool", "raised", "timeout")


class ToolRunner:
    """A thread pool that runs tool calls with a timeout and a length cap on results."""

    def __init__(self, tokenizer: Any, *, timeout_s: float, max_tokens: int, workers: int) -> None:
        self.codec = Codec(tokenizer)
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="posttrain-tool")

    def cap(self, text: str) -> tuple[str, bool]:
        """``text`` cut to ``max_tokens`` tokens and marked, and whether it was cut."""
        ids = self.codec.encode(text)
        if len(ids) <= self.max_tokens:
            return text, False
        return self.codec.decode(ids[: self.max_tokens]) + TRUNCATED, True

    def submit(self, call: ToolCall, tools: dict[str, Callable[..., Any]]) -> Future | ToolResult:
        fn = tools.get(call.name)
        if fn is None:
            have = ", ".join(sorted(tools)) or "none"
            return ToolResult(call.name, f"error: unknown tool {call.name!r} (tools: {have})", "unknown_tool")
        return self.pool.submit(fn, **call.arguments)

    def collect(self, call: ToolCall, job: Future | ToolResult, deadline: float) -> ToolResult:
        if isinstance(job, ToolResult):
            return job
        try:
            value = job.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            return ToolResult(
                call.name, f"error: {call.name} did not return within {self.timeout_s}s", "timeout"
            )
        except Exception as exc:  # the model sees what went wrong, the episode goes on
            return ToolResult(call.name, f"error: {call.name} raised {type(exc).__name__}: {exc}", "raised")
        return ToolResult(call.name, value if isinstance(value, str) else str(value))

    def run(self, batches: Sequence[tuple[Sequence[ToolCall], dict[str, Callable[..., Any]]]]) -> list[list]:
        """The results of several episodes' calls (``(calls, tools)`` each), all submitted before any is
        awaited."""
        deadline = time.monotonic() + self.timeout_s
        jobs = [[(c, self.submit(c, tools)) for c in calls] for calls, tools in batches]
        return [[self.collect(c, job, deadline) for c, job in row] for row in jobs]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
