"""Per-request timings of a vLLM rollout's server executor, for the agent bench: where a turn's time goes.

:func:`attach` wraps the rollout's ``AsyncFront._one`` (every request of both agent loops passes through it)
and records, per request, the host's submit and return times and vLLM's own ``RequestOutput.metrics``: when
the engine core queued and scheduled it, and when it produced its first and last token (vLLM stamps these with
``time.monotonic()`` in the engine-core process, the host's clock here). :meth:`RequestLog.summary` reduces
them:

- ``mean_in_flight``: requests in flight, averaged over the seconds with at least one (host side);
- ``itl_ms``: engine-core seconds between a request's first and last token over its tokens after the first,
  token-weighted: the time of one decode step as requests see it;
- ``queue_ms``, ``prefill_ms``: mean queued-to-scheduled and scheduled-to-first-token times;
- ``front_ms``: mean host lifetime less the engine-core lifetime (queued to last token): input processing,
  the hand-offs between processes and threads, and output processing; ``front_in_ms`` is its part before
  the engine core queued the request, ``front_out_ms`` the part after the last token;
- ``prefix_hit``: prompt tokens served from the prefix cache over all prompt tokens.

So ``tokens/s ~ mean_in_flight / itl``: an arm that generates slowly either holds fewer requests in flight
(starved by the loop, its tools or the front end) or takes longer per step (the GPU side). Requests whose
output has no metrics (vLLM started with ``disable_log_stats``) count on the host side only.
"""

from __future__ import annotations

import time
from typing import Any


class RequestLog:
    """The requests made through one rollout while attached; :meth:`detach` restores the rollout."""

    def __init__(self, front: Any) -> None:
        self.front, self.rows, self.inner = front, [], front._one

        async def one(prompt: Any, params: Any, lora: Any) -> Any:
            start = time.monotonic()
            out = await self.inner(prompt, params, lora)
            self.rows.append((start, time.monotonic(), out))
            return out

        front._one = one

    def detach(self) -> None:
        self.front._one = self.inner

    def summary(self, busy_s: float) -> dict[str, float]:
        """The reductions of the module docstring (empty when no request was logged)."""
        if not self.rows:
            return {}
        host = sum(stop - start for start, stop, _ in self.rows)
        out: dict[str, float] = {"requests": float(len(self.rows))}
        out["mean_in_flight"] = host / busy_s if busy_s > 0 else 0.0
        timed = [(start, stop, o.metrics, o) for start, stop, o in self.rows if _complete(o.metrics)]
        if timed:
            steps = sum(max(m.num_generation_tokens - 1, 0) for _, _, m, _ in timed)
            decode = sum(m.last_token_ts - m.first_token_ts for _, _, m, _ in timed)
            out["itl_ms"] = 1e3 * decode / steps if steps else 0.0
            out["queue_ms"] = 1e3 * _mean([m.scheduled_ts - m.queued_ts for _, _, m, _ in timed])
            out["prefill_ms"] = 1e3 * _mean([m.first_token_ts - m.scheduled_ts for _, _, m, _ in timed])
            out["front_in_ms"] = 1e3 * _mean([m.queued_ts - start for start, _, m, _ in timed])
            out["front_out_ms"] = 1e3 * _mean([stop - m.last_token_ts for _, stop, m, _ in timed])
            out["front_ms"] = out["front_in_ms"] + out["front_out_ms"]
            prompt = sum(len(o.prompt_token_ids or ()) for _, _, _, o in timed)
            cached = sum(o.num_cached_tokens or 0 for _, _, _, o in timed)
            out["prefix_hit"] = cached / prompt if prompt else 0.0
        return out


def _complete(metrics: Any) -> bool:
    return metrics is not None and getattr(metrics, "last_token_ts", 0.0) > 0.0 and metrics.queued_ts > 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def attach(rollout: Any) -> RequestLog | None:
    """A log of ``rollout``'s requests, or None when it has no server-executor front end (``AsyncFront``)."""
    front = getattr(rollout, "engine", None)
    if front is None or not hasattr(front, "_one"):
        return None
    return RequestLog(front)
