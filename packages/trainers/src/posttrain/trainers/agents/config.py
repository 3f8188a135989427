"""``agent``: the multi-turn agent loop's config (off unless ``agent.env`` is set)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class AgentConfig:
    """Multi-turn rollouts with an environment and tools (see docs/agents.md)."""

    env: str | None = None
    """Environment name in the ``posttrain.environments`` entry-point group (e.g. ``calculator``), or an
    importable ``module:Class``; None: single-turn rollouts. A data row's ``extra_info.env`` names another one
    for that row."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor; a row's ``extra_info.env_kwargs`` replaces them."""
    parser: str = "hermes"
    """Tool-call format: ``hermes`` (``<tool_call>{json}</tool_call>``, Qwen2.5), ``llama3_json``, or
    ``qwen3_coder`` (``<tool_call><function=NAME><parameter=KEY>value</parameter>...``, Qwen3-Coder and
    Qwen3.5; values typed by the tools' schemas)."""
    loop: str = "batched"
    """``batched``: one generate call per turn over every live episode (any rollout; the CPU default).
    ``async``:
    each episode advances on its own through ``rollout.agenerate`` (the vLLM rollout with
    ``rollout.executor=server``; the HF rollout serves one request at a time), no barrier between turns;
    ``trainer.mode=stream`` needs it."""
    max_turns: int = 4
    """Assistant turns per episode; an episode still calling tools after the last one is truncated."""
    max_tokens_per_turn: int | None = None
    """New tokens per assistant turn (None: ``rollout.response_length``)."""
    max_episode_tokens: int | None = None
    """Tokens after the prompt (model and environment together; None: ``rollout.response_length``); an episode
    that reaches it is truncated."""
    max_tool_response_tokens: int = 256
    """A tool result longer than this is cut to it and marked ``[truncated]``."""
    tool_timeout_s: float = 10.0
    """A tool call that has not returned this long after its submission is a ``timeout`` error."""
    tool_workers: int = 256
    """Tool calls that run at once (threads, started as needed); with ``loop=async`` also the episodes whose
    tools and ``env.step`` run at once. Calls beyond it wait for a thread, so keep it at least the episodes of
    a step (prompts x ``rollout.n``) when tools mostly wait (network, sleep)."""
    truncated_reward: float | None = 0.0
    """The score of a truncated episode; None scores it like a finished one (the reward function over its
    text)."""

    def __post_init__(self) -> None:
        from .parsers import PARSERS

        if self.parser not in PARSERS:
            raise ValueError(f"agent.parser={self.parser!r} is unknown: use one of {', '.join(PARSERS)}")
        if self.loop not in ("batched", "async"):
            raise ValueError(f"agent.loop={self.loop!r} is unknown: use batched or async")
        for key in ("max_turns", "max_tool_response_tokens", "tool_workers"):
            if getattr(self, key) < 1:
                raise ValueError(f"agent.{key}={getattr(self, key)} must be >= 1")
        for key in ("max_tokens_per_turn", "max_episode_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"agent.{key}={value} must be >= 1 or null")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"agent.tool_timeout_s={self.tool_timeout_s} must be > 0")

    def check_rollout(self, rollout_config: Any) -> None:
        """Refuse ``loop=async`` over a rollout whose config says it serves no single requests (vLLM without
        ``rollout.executor=server``), before anything is built."""
        if self.env is not None and self.loop == "async" and rollout_config.serves_requests is False:
            raise ValueError(
                f"agent.loop=async needs a rollout that generates one request at a time (agenerate): "
                f"rollout.name={rollout_config.name} with these settings does not; use rollout.name=vllm "
                "with rollout.executor=server, or agent.loop=batched"
            )

    def build(self, tokenizer: Any, rollout_config: Any):
        """The agent loop for ``tokenizer`` and the rollout's lengths, or None when ``env`` is unset."""
        if self.env is None:
            return None
        from .loop import AgentLoop

        return AgentLoop(self, tokenizer, rollout_config)
