"""Render a chat with the tokenizer's chat template and mark the assistant tokens as training targets.

A conversation of ``n`` messages is rendered ``n`` times as growing prefixes: the text each message adds is
the difference between consecutive renderings, and for an assistant message the prefix is rendered with
``add_generation_prompt=True`` so the role header (``<|im_start|>assistant\\n``) belongs to the prompt and
only the reply and its end-of-turn marker are targets. Segments are tokenised one at a time, exactly as a
rollout sees a prompt and then the generated reply. A template whose renderings are not prefixes of each other
is rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def tokenize_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[float]]:
    """(token ids, loss mask) of one conversation: mask 1 on assistant replies, 0 elsewhere."""
    ids: list[int] = []
    mask: list[float] = []
    done = ""
    for i, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant:
            header = _render(tokenizer, messages[:i], generation_prompt=True)
            _extend(tokenizer, ids, mask, done, header, 0.0)
            done = header
        full = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        _extend(tokenizer, ids, mask, done, full, 1.0 if assistant else 0.0)
        done = full
    return ids, mask


def _extend(tokenizer: Any, ids: list[int], mask: list[float], done: str, text: str, value: float) -> None:
    if not text.startswith(done):
        raise ValueError(
            "the tokenizer's chat template does not render conversations as growing prefixes "
            f"(rendering of a longer chat does not start with {done[-40:]!r}); use a template "
            "where each message only appends text"
        )
    piece = text[len(done) :]
    if piece:
        new = tokenizer(piece, add_special_tokens=False)["input_ids"]
        ids.extend(new)
        mask.extend([value] * len(new))


def truncate(ids: list[int], mask: list[float], max_length: int, mode: str, where: str) -> tuple[list, list]:
    """Apply ``data.truncation`` to one tokenised sample (``where`` names it in the error)."""
    if len(ids) <= max_length:
        return ids, mask
    if mode == "error":
        raise ValueError(
            f"{where} has {len(ids)} tokens, more than data.max_length={max_length}: raise "
            "data.max_length, set data.truncation=left|right, or drop the sample"
        )
    if mode == "left":
        return ids[-max_length:], mask[-max_length:]
    return ids[:max_length], mask[:max_length]
