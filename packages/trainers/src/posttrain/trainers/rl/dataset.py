"""RL prompts from parquet files in verl's column layout.

Columns: ``prompt`` (a chat list, rendered with the tokenizer's chat template and the generation prompt),
``data_source`` (selects the reward function), ``reward_model`` (a struct with ``ground_truth``) and optionally
``extra_info``. Prompts longer than ``data.max_prompt_length`` tokens are dropped with a count printed, as verl's
``filter_overlong_prompts`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..data.config import DataConfig
from ..data.parquet import CHAT, read_tables


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


def _check_reward_column(table: pa.Table, key: str) -> None:
    t = table.schema.field("reward_model").type
    if not (pa.types.is_struct(t) and t.get_field_index("ground_truth") >= 0):
        raise ValueError(
            f"{key}: column 'reward_model' has type {t}, expected struct<ground_truth: string, ...>"
        )


class PromptDataset:
    """Tokenised prompts with their reward metadata."""

    def __init__(
        self, files: Sequence[str], tokenizer: Any, config: DataConfig, key: str = "data.train_files"
    ):
        table = read_tables(files, {config.prompt_key: CHAT, config.reward_fn_key: "string"}, key)
        full = pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
        if "reward_model" not in full.schema.names:
            raise ValueError(f"{key}: column 'reward_model' is missing (columns are {full.schema.names})")
        _check_reward_column(full, key)
        self.items: list[Prompt] = []
        self.dropped = 0
        for row, prompt in zip(full.to_pylist(), table.column(config.prompt_key).to_pylist()):
            ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            if len(ids) > config.max_prompt_length:
                self.dropped += 1
                continue
            truth = str(row["reward_model"]["ground_truth"])
            self.items.append(
                Prompt(list(ids), row[config.reward_fn_key], truth, row.get("extra_info") or {})
            )
        if not self.items:
            raise ValueError(
                f"{key}: every prompt is longer than data.max_prompt_length={config.max_prompt_length}"
                " tokens: raise it"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prompt:
        return self.items[i]
