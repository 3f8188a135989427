"""File-list config values given as one plain string.

verl's configs and command lines write ``data.train_files=/path/train.parquet``; the config schema holds a
list, so :func:`coerce_file_lists` turns a plain string under any key ending in ``_files`` into a one-element
list before the overrides are merged.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def coerce_file_lists(node: Any) -> Any:
    """``node`` (a DictConfig of overrides) with every string value of a ``*_files`` key made a one-element
    list, in place; returns ``node``."""
    if isinstance(node, DictConfig):
        for key in list(node.keys()):
            value = node[key]
            if str(key).endswith("_files") and isinstance(value, str):
                node[key] = [value]
            elif isinstance(value, DictConfig):
                coerce_file_lists(value)
    return node
