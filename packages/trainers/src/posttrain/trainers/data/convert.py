"""Convert local copies of GSM8K and MATH into posttrain's columns (SFT ``messages`` + verl's RL columns).

Nothing is downloaded: the input is a parquet or JSON-lines file in the dataset's published format.
GSM8K rows have ``question`` and ``answer`` (worked solution ending in ``#### <number>``); the ground truth is
the text after ``####`` with thousands separators removed. MATH rows have ``problem`` and ``solution``; the
ground truth is the content of the solution's last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .synthetic import make_row

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local ``.parquet`` or ``.jsonl``/``.json`` file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"--input {str(path)!r} does not exist (posttrain downloads nothing: pass a local file)"
        )
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    raise ValueError(f"--input {str(path)!r}: use a .parquet, .jsonl or .json file")


def _require(row: dict, keys: tuple[str, ...], path: str, i: int) -> None:
    missing = [k for k in keys if not isinstance(row.get(k), str)]
    if missing:
        raise ValueError(f"{path} row {i}: missing or non-string field(s) {missing}; have {sorted(row)}")


def gsm8k_answer(answer: str) -> str:
    """The final number of a GSM8K solution (after ``####``, commas removed)."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' line: {answer[-80:]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def last_boxed(solution: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``solution``; None if there is none."""
    start = max(solution.rfind("\\boxed{"), solution.rfind("\\fbox{"))
    if start < 0:
        return None
    i = solution.index("{", start)
    depth = 0
    for j in range(i, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[j], 0)
        if depth == 0:
            return solution[i + 1 : j]
    return None


def convert(
    task: str, records: list[dict[str, Any]], split: str, path: str = "input"
) -> list[dict[str, Any]]:
    """Rows of ``task`` (gsm8k or math) in posttrain's columns."""
    rows = []
    for i, r in enumerate(records):
        if task == "gsm8k":
            _require(r, ("question", "answer"), path, i)
            q, a, truth, src, inst = (
                r["question"],
                r["answer"],
                gsm8k_answer(r["answer"]),
                GSM8K_SOURCE,
                GSM8K_INSTRUCTION,
            )
        elif task == "math":
            _require(r, ("problem", "solution"), path, i)
            truth = last_boxed(r["solution"])
            if truth is None:
                raise ValueError(f"{path} row {i}: the solution has no \\boxed{{...}} answer")
            q, a, src, inst = r["problem"], r["solution"], MATH_SOURCE, MATH_INSTRUCTION
        else:
            raise ValueError(f"unknown dataset {task!r}: use gsm8k or math")
        rows.append(
            make_row(q, a, truth, data_source=src, ability="math", instruction=inst, split=split, index=i)
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` to ``path`` (parent directories created)."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
