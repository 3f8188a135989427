"""Token-in-token-out trajectories: the ids the rollout sampled, and each environment message's ids, appended.

Nothing the model generated is ever decoded and tokenized again. The first observation is rendered once with the
chat template and its generation prompt. After a model turn that ended on its stop token, the environment's
messages (tool results, feedback) are rendered *incrementally*: the template renders a fixed two-message context
``[user, assistant]`` with and without the new messages (and the generation prompt); the text the new messages
add is the suffix, and the separator the template writes after the assistant's stop token (``"\\n"`` after
ChatML's ``<|im_end|>``, nothing after Llama 3's ``<|eot_id|>``) is put in front of it. Only that text is
tokenized, so the ids at each assistant/environment boundary are exactly what the full render would hold there
(verl's lost-separator bug cannot happen), and the model's own ids are the sampled ones.

The prefix property (each turn's ids = the full render of the conversation so far) then holds whenever the model
sampled the canonical tokenization of its text and the template writes past assistant messages as they were. A
template that rewrites history breaks the equality but not the trajectory: Llama 3's template ``trim``s message
content, Qwen3's drops past ``<think>`` blocks. posttrain keeps the sampled ids (what the policy really
conditioned on) and does not re-render; a template whose rendering with the new messages does not start with its
rendering without them (the incremental suffix is then undefined) is a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.core.env import Message

_CONTEXT = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


class ChatRenderer:
    """Renders observations to ids with ``tokenizer``'s chat template and the tools' schemas."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self._separators: dict[int, str] = {}

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def initial(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the first observation with the generation prompt."""
        return self.encode(self.render(messages, True))

    def separator(self, stop_id: int) -> str:
        """The text the template writes after an assistant message's ``stop_id`` token."""
        if stop_id not in self._separators:
            stop = self.tokenizer.decode([stop_id])
            base = self.render(_CONTEXT, False)
            at = base.rfind(stop)
            if at < 0:
                raise ValueError(
                    f"the chat template never writes the stop token {stop!r} after an assistant message: set "
                    "the tokenizer's eos token (or agent stop tokens) to the token that ends an assistant turn"
                )
            self._separators[stop_id] = base[at + len(stop) :]
        return self._separators[stop_id]

    def continuation(self, new: Sequence[Message], stop_id: int) -> list[int]:
        """The ids that follow an assistant turn that ended on ``stop_id``: the template's separator, the new
        messages and the generation prompt."""
        base = self.render(_CONTEXT, False)
        full = self.render([*_CONTEXT, *new], True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders [user, assistant] differently once more messages follow, so the ids of "
                f"the new messages are not a suffix (without: ...{base[-60:]!r}, with: ...{full[: len(base)][-60:]!r}); "
                "use a template that renders past messages the same way whatever follows"
            )
        return self.encode(self.separator(stop_id) + full[len(base) :])


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
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([1] * len(ids))
        self.log_probs.extend(float(x) for x in log_probs)

    def add_env(self, ids: Sequence[int]) -> None:
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))

    def context(self) -> list[int]:
        """What the model sees next."""
        return self.prompt_ids + self.ids
