"""Token-in-token-out trajectories: the ids the rollout sampled, and each environment message's ids, appended.

Nothing the model generated is ever decoded and tokenized again. The first observation is rendered once with
the chat template and its generation prompt. After a model turn that ended on its stop token, the
environment's messages (tool results, feedback) are rendered *incrementally*: the template renders a fixed
two-message context ``[user, assistant]`` with and without the new messages (and the generation prompt; the
render without them is kept from the first call); the text the new messages add is the suffix, and the
separator the template writes after the assistant's stop token (``"\\n"`` after ChatML's ``<|im_end|>``,
nothing after Llama 3's ``<|eot_id|>``) is put in front of it. Only that text is tokenized (:mod:`.codec`), so
the ids at each assistant/environment boundary are exactly what the full render would hold there (verl's
lost-separator bug cannot happen), and the model's own ids are the sampled ones.

The prefix property (each turn's ids = the full render of the conversation so far) then holds whenever the
model sampled the canonical tokenization of its text and the template writes past assistant messages as they
were. A template that rewrites history breaks the equality but not the trajectory: Llama 3's template
``trim``s message content, Qwen3's drops past ``<think>`` blocks. posttrain keeps the sampled ids (what the
policy really conditioned on) and does not re-render; a template whose rendering with the new messages does
not start with its rendering without them (the incremental suffix is then undefined) is a ValueError naming
it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.core.env import Message

from .codec import Codec

_CONTEXT = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
KEPT = 256
"""Rendered first observations whose ids a renderer keeps; all are dropped when one more comes."""


class ChatRenderer:
    """Renders observations to ids with ``tokenizer``'s chat template and the tools' schemas.

    One renderer serves every episode with the same tools (:meth:`~.loop.AgentLoop.renderer`), on whichever
    threads they run (the async loop's step pool, the episode stream's thread). What it keeps is immutable
    (the renders are strings, the ids tuples), replaced whole, and each call reads a kept value once into a
    local, so a call never mixes two threads' values; the lock only serializes the fills (check, clear,
    insert)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self.codec = Codec(tokenizer)
        self._lock = threading.Lock()
        self._separators: dict[int, str] = {}
        self._base: str | None = None
        """The render of the fixed context ``[user, assistant]`` (re-rendered when a render stops starting
        with it)."""
        self._initial: dict[str, tuple[int, ...]] = {}

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def initial(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the first observation with the generation prompt (those of the last :data:`KEPT`
        rendered texts are kept: the episodes of a GRPO group start from the same one)."""
        text = self.render(messages, True)
        ids = self._initial.get(text)
        if ids is None:
            ids = tuple(self.encode(text))
            with self._lock:
                if len(self._initial) >= KEPT:
                    self._initial.clear()
                self._initial[text] = ids
        return list(ids)

    def separator(self, stop_id: int, base: str | None = None) -> str:
        """The text the template writes after an assistant message's ``stop_id`` token, found in ``base`` (the
        caller's checked render of the context; None: the kept one)."""
        sep = self._separators.get(stop_id)
        if sep is None:
            stop = self.tokenizer.decode([stop_id])
            base = self.base() if base is None else base
            at = base.rfind(stop)
            if at < 0:
                raise ValueError(
                    f"the chat template never writes the stop token {stop!r} after an assistant message: set "
                    "the tokenizer's eos token (or agent stop tokens) to the token that ends an assistant "
                    "turn"
                )
            sep = base[at + len(stop) :]
            with self._lock:
                self._separators[stop_id] = sep
        return sep

    def base(self, fresh: bool = False) -> str:
        """The render of ``[user, assistant]`` without the generation prompt, kept after the first."""
        base = None if fresh else self._base
        if base is None:
            base = self._base = self.render(_CONTEXT, False)
        return base

    def continuation(self, new: Sequence[Message], stop_id: int) -> list[int]:
        """The ids that follow an assistant turn that ended on ``stop_id``: the template's separator, the new
        messages and the generation prompt. One render per call: the context's render is kept, and rendered
        again only when the new render does not start with it (a template that renders, say, today's date)."""
        full = self.render([*_CONTEXT, *new], True)
        base = self.base()
        if not full.startswith(base):
            base = self.base(fresh=True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders [user, assistant] differently once more messages follow, so the "
                f"ids of the new messages are not a suffix (without: ...{base[-60:]!r}, with: "
                f"...{full[: len(base)][-60:]!r}); use a template that renders past messages the same way "
                "whatever follows"
            )
        return self.encode(self.separator(stop_id, base) + full[len(base) :])


def _values(values: torch.Tensor | Sequence[Any], kind: type) -> list[Any]:
    """``values`` as Python ``kind``s; a tensor through one ``tolist`` (iterating it makes a tensor per
    element)."""
    return list(map(kind, values.tolist() if isinstance(values, torch.Tensor) else values))


@dataclass
class Trajectory:
    """One episode's ids after the prompt, with which of them the model sampled."""

    prompt_ids: list[int]
    """The first observation, rendered."""
    ids: list[int] = field(default_factory=list)
    """Everything after the prompt: sampled ids and environment ids, in order."""
    mask: list[int] = field(default_factory=list)
    """1 on the model's sampled ids, 0 on the environment's."""
    log_probs: list[float] = field(default_factory=list)
    """The rollout's log-prob of each sampled id (0.0 on environment ids)."""

    def add_model(self, ids: Sequence[int], log_probs: torch.Tensor | Sequence[float]) -> None:
        self.ids.extend(_values(ids, int))
        self.mask.extend([1] * len(ids))
        self.log_probs.extend(_values(log_probs, float))

    def add_env(self, ids: Sequence[int]) -> None:
        self.ids.extend(_values(ids, int))
        self.mask.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))

    def context(self) -> list[int]:
        """What the model sees next."""
        return self.prompt_ids + self.ids
