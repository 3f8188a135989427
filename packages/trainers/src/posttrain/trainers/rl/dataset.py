"""RL prompts from parquet files in verl's column layout.

Columns: ``prompt`` (a chat list, rendered with the tokenizer's chat template and the generation prompt),
``data_source`` (selects the reward function), ``reward_model`` (a struct with ``ground_truth``) and
optionally ``extra_info``. Each file's columns are checked first, and a row whose ``reward_model`` or
``ground_truth``, or whose reward-function key (``data.reward_fn_key``), is null, or whose prompt is empty, is
rejected with the file and row named. Prompts longer than ``data.max_prompt_length`` tokens are dropped with a
warning that counts them, as verl's ``filter_overlong_prompts`` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..data.config import DataConfig
from ..data.parquet import CHAT, read_table


@dataclass
class Prompt:
    """One RL prompt, tokenised."""

    ids: list[int]
    """Prompt tokens, chat template and generation prompt included."""
    data_source: str
    """Reward function selector."""
    ground_truth: str
    """What the reward compares the answer with."""
    extra_info: dict[str, Any]
    """Anything else the row carried."""
    messages: list[dict[str, Any]] | None = None
    """The prompt chat as the row has it (an environment's ``reset`` reads it)."""


def _check_reward_column(table: pa.Table, key: str) -> None:
    t = table.schema.field("reward_model").type
    if not (pa.types.is_struct(t) and t.get_field_index("ground_truth") >= 0):
        raise ValueError(
            f"{key}: column 'reward_model' has type {t}, expected struct<ground_truth: string, ...>"
        )


def _rows(path: str, config: DataConfig, key: str) -> Iterator[tuple[dict[str, Any], Any]]:
    """(row, prompt chat) of every row of ``path``, after the columns and each row's reward fields are
    checked (a null ``reward_model``, ``ground_truth`` or reward-function key names the file and row)."""
    checked = read_table(path, {config.prompt_key: CHAT, config.reward_fn_key: "string"})
    full = pq.read_table(path)
    if "reward_model" not in full.schema.names:
        raise ValueError(f"{path}: column 'reward_model' is missing (columns are {full.schema.names})")
    _check_reward_column(full, path)
    for i, (row, prompt) in enumerate(zip(full.to_pylist(), checked.column(config.prompt_key).to_pylist())):
        where = f"{path} row {i}"
        if row["reward_model"] is None or row["reward_model"]["ground_truth"] is None:
            raise ValueError(
                f"{where}: reward_model.ground_truth is null, so the reward has nothing to compare with "
                f"({key}); fill it in or drop the row"
            )
        if row[config.reward_fn_key] is None:
            raise ValueError(
                f"{where}: {config.reward_fn_key} is null, so no reward function is chosen ({key}); fill it "
                "in or drop the row"
            )
        if not prompt:
            raise ValueError(f"{where}: the prompt chat {config.prompt_key!r} is empty ({key})")
        yield row, prompt


class PromptDataset:
    """Tokenised prompts with their reward metadata."""

    def __init__(
        self, files: Sequence[str], tokenizer: Any, config: DataConfig, key: str = "data.train_files"
    ):
        if not files:
            raise ValueError(
                f"{key} is empty: give at least one parquet file, e.g. {key}=[data/train.parquet]"
            )
        max_len = config.max_prompt_length
        if max_len is None:
            raise ValueError(
                "data.max_prompt_length is unset: resolve it with DataConfig.prompt_length first"
            )
        self.items: list[Prompt] = []
        self.dropped = 0
        for path in files:
            for row, prompt in _rows(path, config, key):
                ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                if len(ids) > max_len:
                    self.dropped += 1
                    continue
                truth = str(row["reward_model"]["ground_truth"])
                self.items.append(
                    Prompt(list(ids), row[config.reward_fn_key], truth, row.get("extra_info") or {}, prompt)
                )
        if not self.items:
            raise ValueError(
                f"{key}: every prompt is longer than {max_len} tokens: raise rollout.prompt_length (the "
                "prompt length of both the rollout and this filter)"
            )
        if self.dropped:
            warnings.warn(
                f"{key}: dropped {self.dropped} of {self.dropped + len(self.items)} prompts longer than "
                f"data.max_prompt_length={max_len} tokens (set by rollout.prompt_length)",
                UserWarning,
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prompt:
        return self.items[i]
