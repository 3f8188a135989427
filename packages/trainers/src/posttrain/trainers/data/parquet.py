"""Reading parquet datasets with their columns checked before any training starts.

Every file is opened with pyarrow and its schema compared with what the trainer needs: a missing column, a
column of the wrong type or a file with no rows fails with a ``ValueError`` that names the file, the column
and what was expected. Chat columns must be ``list<struct<role: string, content: string>>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _is_chat(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    names = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    return all(
        k in names and (pa.types.is_string(names[k]) or pa.types.is_large_string(names[k]))
        for k in ("role", "content")
    )


CHAT = "list<struct<role: string, content: string>>"
"""Spelling of the chat column type in error messages."""


def check_column(path: str, schema: pa.Schema, column: str, expected: str) -> None:
    """Raise unless ``schema`` has ``column`` of type ``expected`` (``CHAT`` or ``string``)."""
    if column not in schema.names:
        raise ValueError(
            f"{path}: column {column!r} is missing (columns are {schema.names}); set the data key "
            f"(e.g. data.messages_key) to the column that holds it or fix the file"
        )
    t = schema.field(column).type
    ok = _is_chat(t) if expected == CHAT else (pa.types.is_string(t) or pa.types.is_large_string(t))
    if not ok:
        raise ValueError(f"{path}: column {column!r} has type {t}, expected {expected}")


def read_table(path: str | Path, columns: dict[str, str]) -> pa.Table:
    """One parquet file's ``columns`` (name -> expected type), checked; a ValueError names any problem."""
    path = str(path)
    if not Path(path).is_file():
        raise ValueError(f"data file {path!r} does not exist")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    schema = pf.schema_arrow
    for column, expected in columns.items():
        check_column(path, schema, column, expected)
    if pf.metadata.num_rows == 0:
        raise ValueError(f"{path}: the file has no rows")
    return pf.read(columns=list(columns))


def read_tables(paths: Sequence[str], columns: dict[str, str], key: str) -> pa.Table:
    """Concatenate the checked ``columns`` of every file in ``paths`` (``key`` names the config list)."""
    if not paths:
        raise ValueError(f"{key} is empty: give at least one parquet file, e.g. {key}=[data/train.parquet]")
    tables = [read_table(p, columns) for p in paths]
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
