"""The one dtype parser: every alias maps onto its torch dtype, anything else names the value and the
choices."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.dtypes import dtype_name, parse_dtype


@pytest.mark.parametrize(
    ("spelling", "want"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.half, torch.float16),
        (torch.float32, torch.float32),
    ],
)
def test_every_spelling_parses(spelling, want):
    assert parse_dtype(spelling) is want
    assert dtype_name(spelling) == str(want).removeprefix("torch.")


@pytest.mark.parametrize("bad", ["int8", "float64", "bf8", "", torch.float64, torch.int32])
def test_unknown_dtype_names_value_key_and_choices(bad):
    with pytest.raises(ValueError, match=r"rollout\.dtype=.*use one of bfloat16, float16, float32, bf16"):
        parse_dtype(bad, "rollout.dtype")
