"""The SFT dataset: chat conversations from parquet, tokenised once with loss on assistant replies.

All files are read and checked first (a missing or mistyped ``data.messages_key`` column or an empty file
fails before tokenisation), then every conversation is rendered with the tokenizer's chat template
(:func:`~posttrain.trainers.data.chat.tokenize_chat`), truncated per ``data.truncation`` (``error`` names the
file, row and length) and kept in memory. The first token of a sample is never a target (it has no context).
Batches come out as :class:`~posttrain.core.PackedBatch` with no padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.core import PackedBatch

from .chat import tokenize_chat, truncate
from .config import DataConfig
from .parquet import CHAT, read_table

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any, where: str) -> None:
    """Raise unless ``messages`` is a non-empty chat with at least one assistant reply."""
    if not messages:
        raise ValueError(f"{where}: the chat is empty")
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {m!r} needs a role in {ROLES} and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on")


class SFTDataset:
    """Tokenised conversations: ``input_ids[i]``, ``loss_mask[i]`` and where each came from."""

    def __init__(
        self, files: Sequence[str], tokenizer: Any, config: DataConfig, key: str = "data.train_files"
    ):
        if not files:
            raise ValueError(
                f"{key} is empty: give at least one parquet file, e.g. {key}=[data/train.parquet]"
            )
        tables = [(f, read_table(f, {config.messages_key: CHAT})) for f in files]
        self.input_ids: list[list[int]] = []
        self.loss_mask: list[list[float]] = []
        self.sources: list[str] = []
        for path, table in tables:
            for row, messages in enumerate(table.column(config.messages_key).to_pylist()):
                where = f"{path} row {row}"
                check_messages(messages, where)
                ids, mask = tokenize_chat(tokenizer, messages)
                ids, mask = truncate(ids, mask, config.max_length, config.truncation, where)
                mask[0] = 0.0
                self.input_ids.append(ids)
                self.loss_mask.append(mask)
                self.sources.append(where)

    def __len__(self) -> int:
        return len(self.input_ids)

    def num_tokens(self, indices: Sequence[int]) -> int:
        """Tokens in the samples ``indices``."""
        return sum(len(self.input_ids[i]) for i in indices)

    def batch(self, indices: Sequence[int], meta: dict[str, Any] | None = None) -> PackedBatch:
        """The samples ``indices`` packed end to end."""
        if not indices:
            raise ValueError("SFTDataset.batch needs at least one sample index")
        return PackedBatch.from_sequences(
            [self.input_ids[i] for i in indices], [self.loss_mask[i] for i in indices], meta=meta
        )
