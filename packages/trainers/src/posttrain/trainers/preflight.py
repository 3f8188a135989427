"""Checks that run before the first step, before any engine is built: each failure is a ``ConfigError`` (the
command exits 2) naming the key and the fix, so no work is lost to a mistake found later.

* ``trainer.default_local_dir`` can be created and written (a probe file) and its file system has room for one
  checkpoint, estimated from the parameter count: fp32 weights (4 bytes a parameter) plus AdamW's two fp32
  moments (8) when ``optimizer`` is saved, plus the model's own dtype when ``hf_model`` is, for every trained
  role;
* lengths fit: SFT's ``data.max_length`` and RL's ``rollout.prompt_length + rollout.response_length`` within
  the model's ``max_position_embeddings`` and within ``rollout.max_model_len`` when that is set;
* the data has the columns the config names (SFT: ``data.messages_key``; RL: ``data.prompt_key``,
  ``data.reward_fn_key`` and ``reward_model``), checked from the parquet schemas;
* RL: every ``data_source`` of the training and validation files has a rule-based scorer, unless
  ``reward.custom_reward_function`` is set.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.core.config.loader import ConfigError

from .data.parquet import CHAT, check_column
from .rewards.score import has_rule, known_sources

FP32, ADAM_MOMENTS = 4, 8
"""Bytes a parameter of a checkpoint holds: fp32 weights, and AdamW's exp_avg and exp_avg_sq."""


def check_sft(cfg: Any) -> None:
    """Every check an SFT run needs, before its engine is built."""
    model = _model_config(cfg)
    _check_lengths(model, {"data.max_length": cfg.data.max_length}, None)
    for key, files in _file_lists(cfg):
        for path in files:
            _check_columns(path, key, {cfg.data.messages_key: ("data.messages_key", CHAT)})
    if _rank() == 0:
        check_output_dir(cfg, roles=1)


def check_rl(cfg: Any, use_critic: bool) -> None:
    """Every check a PPO/GRPO run needs, before its engines are built."""
    model = _model_config(cfg)
    ro = cfg.rollout
    total = ro.prompt_length + ro.response_length
    _check_lengths(
        model, {"rollout.prompt_length + rollout.response_length": total}, getattr(ro, "max_model_len", None)
    )
    columns = {
        cfg.data.prompt_key: ("data.prompt_key", CHAT),
        cfg.data.reward_fn_key: ("data.reward_fn_key", "string"),
        "reward_model": ("the reward_model column (a struct with ground_truth)", None),
    }
    sources: dict[str, str] = {}
    for key, files in _file_lists(cfg):
        for path in files:
            _check_columns(path, key, columns)
            for source in (
                pq.read_table(path, columns=[cfg.data.reward_fn_key]).column(0).unique().to_pylist()
            ):
                sources.setdefault(str(source), f"{key} ({path})")
    if not cfg.reward.custom_reward_function:
        unknown = {s: where for s, where in sources.items() if not has_rule(s)}
        if unknown:
            raise ConfigError(
                f"no scorer for data_source {', '.join(map(repr, sorted(unknown)))} (in "
                f"{next(iter(unknown.values()))}): the rule-based scorers know {known_sources()}; set "
                "reward.custom_reward_function=module:function (or path/to/file.py:function) that scores them"
            )
    if _rank() == 0:  # one rank probes the shared folder (torchrun stops the others when it exits)
        check_output_dir(cfg, roles=2 if use_critic else 1)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _model_config(cfg: Any) -> dict[str, Any]:
    path = Path(cfg.model.path or "") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # model.path itself is checked (and named) by require_weights


def _check_lengths(model: dict[str, Any], lengths: dict[str, int], max_model_len: int | None) -> None:
    positions = model.get("max_position_embeddings")
    for key, n in lengths.items():
        if positions is not None and n > positions:
            raise ConfigError(
                f"{key} = {n} tokens exceeds the model's max_position_embeddings={positions}: lower {key} "
                f"to at most {positions} in total"
            )
        if max_model_len is not None and n > max_model_len:
            raise ConfigError(
                f"{key} = {n} tokens exceeds rollout.max_model_len={max_model_len}: raise "
                f"rollout.max_model_len to {n} or leave it null (then it is prompt_length + response_length)"
            )


def _file_lists(cfg: Any) -> list[tuple[str, list[str]]]:
    out = [("data.train_files", list(cfg.data.train_files))]
    if cfg.data.val_files:
        out.append(("data.val_files", list(cfg.data.val_files)))
    for key, files in out:
        missing = [f for f in files if not Path(f).is_file()]
        if not files or missing:
            raise ConfigError(
                f"{key}={files}: {'no files' if not files else f'{missing[0]!r} does not exist'}; give the "
                f"parquet files as {key}=[path/a.parquet,path/b.parquet] (one path alone also works)"
            )
    return out


def _check_columns(path: str, key: str, columns: dict[str, tuple[str, str | None]]) -> None:
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"{key}: {path} is not a readable parquet file ({exc})") from None
    for column, (config_key, expected) in columns.items():
        if column not in schema.names:
            raise ConfigError(
                f"{key}: {path}: column {column!r} is missing (its columns: {schema.names}); {config_key} "
                f"names it: set {config_key} to the column that holds it, or fix the file"
            )
        if expected is not None:
            try:
                check_column(path, schema, column, expected)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc} ({config_key})") from None


def checkpoint_bytes(cfg: Any, roles: int) -> int:
    """Estimated bytes of one checkpoint (see the module docstring)."""
    from .model_init import count_parameters

    params = count_parameters(cfg.model.path)
    contents = cfg.checkpoint.save_contents
    per_param = (FP32 if "model" in contents else 0) + (ADAM_MOMENTS if "optimizer" in contents else 0)
    if "hf_model" in contents:
        per_param += 2
    return params * per_param * roles


def _room(cfg: Any, out: Path, roles: int) -> tuple[int, int]:
    """(bytes one checkpoint needs, bytes free under ``out``); no need when model.path has no config."""
    if not (Path(cfg.model.path or "") / "config.json").is_file():
        return 0, 0  # model.path itself is checked (and named) by require_weights
    return checkpoint_bytes(cfg, roles), shutil.disk_usage(out).free


def check_output_dir(cfg: Any, roles: int) -> None:
    """``trainer.default_local_dir`` is writable and has room for one checkpoint."""
    out = Path(cfg.trainer.default_local_dir)
    key = "trainer.default_local_dir"
    probe = out / f".posttrain-write-probe-{uuid.uuid4().hex}"
    created = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"posttrain")
        probe.unlink()
        need, free = _room(cfg, out, roles)
    except OSError as exc:
        raise ConfigError(
            f"{key}={str(out)!r} cannot be written ({type(exc).__name__}: {exc.strerror or exc}): "
            f"checkpoints and logs go there; point {key} at a folder you can write"
        ) from None
    finally:
        for path in created:  # leave no trace: the trainer creates the folder when it writes
            if path.is_dir():
                path.rmdir()
    if need > free:
        raise ConfigError(
            f"{key}={str(out)!r} has {free / 1e9:.2f} GB free, and one checkpoint needs about "
            f"{need / 1e9:.2f} GB (checkpoint.save_contents={list(cfg.checkpoint.save_contents)}): free "
            f"space or point {key} at a larger file system"
        )
