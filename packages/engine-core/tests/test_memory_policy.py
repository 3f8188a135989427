"""The memory-for-speed policy: byte counts against hand arithmetic, and each choice flipping where its budget
says it should."""

from __future__ import annotations

import json

import pytest

from posttrain.core.memory_policy import (
    HEADROOM,
    ModelShape,
    choose_gradient_checkpointing,
    choose_max_num_seqs,
    choose_ref_offload,
    choose_token_budget,
    rollout_reserve_bytes,
)
from posttrain.core.testing import QWEN25_05B, QWEN25_15B

GiB = 2**30


def test_shape_counts_qwen_05b_parameters_and_kv_bytes(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    shape = ModelShape.from_path(tmp_path)
    # 494,032,768 parameters in the real model (its q/k/v biases, 1,536 per layer... left out here)
    assert abs(shape.params - 494_032_768) / 494_032_768 < 0.002
    assert shape.kv_bytes_per_token == 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 heads of 64, bf16
    assert shape.train_state_bytes(world=2) == 16 * shape.params // 2


def test_activation_bytes_by_hand() -> None:
    s = ModelShape(params=0, layers=3, hidden=10, intermediate=20, vocab=7, kv_bytes_per_token=0)
    per_layer = 2 * (10 * 10 + 4 * 20) * 5  # 5 tokens
    assert s.activation_bytes(5, checkpointing=False) == 3 * per_layer + 4 * 7 * 5
    assert s.activation_bytes(5, checkpointing=True) == 3 * 2 * 10 * 5 + per_layer + 4 * 7 * 5


def test_checkpointing_turns_on_exactly_past_the_budget() -> None:
    s = ModelShape.from_hf_config(QWEN25_05B)
    tokens = 16384
    need = s.train_state_bytes(1) + s.activation_bytes(tokens, checkpointing=False)
    free_fits = int(need / HEADROOM) + 16
    assert choose_gradient_checkpointing(s, tokens, free_fits).value is False
    assert choose_gradient_checkpointing(s, tokens, free_fits - 64).value is True
    # an H200's free memory holds the 0.5B shape's 16k-token micro-batch without recomputation
    off = choose_gradient_checkpointing(s, tokens, 139 * GiB)
    assert off.value is False and "fit in" in off.reason
    assert choose_gradient_checkpointing(s, tokens, 40 * GiB).value is True


def test_a_rollout_beside_the_update_takes_its_share_first() -> None:
    s = ModelShape.from_hf_config(QWEN25_05B)
    free, tokens = 80 * GiB, 16384
    held = 6 * s.params  # the actor's fp32 weights and the bf16 reference, built before the rollout
    reserve = rollout_reserve_bytes(s, free, 1, 0.6, ref_on_device=True)
    assert reserve == int(0.6 * (free - held))
    assert rollout_reserve_bytes(s, free, 1, 0.6, ref_on_device=False) == int(0.6 * (free - 4 * s.params))
    assert rollout_reserve_bytes(s, free, 1, 0.6, ref_on_device=True, gib=12) == 12 * GiB
    assert choose_gradient_checkpointing(s, tokens, free).value is False
    beside = choose_gradient_checkpointing(s, tokens, free, beside=reserve)
    assert (
        beside.value is True
        and f"of 80.0 GiB free less {reserve / GiB:.1f} GiB held beside the update" in beside.reason
    )


def test_ref_offload_only_when_the_rollout_would_not_fit() -> None:
    s = ModelShape.from_hf_config(QWEN25_05B)
    tokens = 640 * 1536  # 128 prompts x 5 responses x (512 + 1024) tokens
    keep = choose_ref_offload(s, 139 * GiB, world=1, rollout_share=0.6, rollout_tokens=tokens)
    assert keep.value is False
    assert choose_ref_offload(s, 20 * GiB, world=1, rollout_share=0.6, rollout_tokens=tokens).value is True


@pytest.mark.parametrize(("seqs", "want"), [(1, 16), (640, 640), (641, 656), (256, 256), (5000, 1024)])
def test_max_num_seqs_covers_one_generate_call(seqs: int, want: int) -> None:
    assert choose_max_num_seqs(seqs).value == want


def test_max_num_seqs_refuses_an_empty_call() -> None:
    with pytest.raises(ValueError, match="sequences=0"):
        choose_max_num_seqs(0)


def test_a_smaller_budget_before_recomputation() -> None:
    """The 1.5B shape on an 80 GB card: 16,384 tokens would need recomputation (the README's run chose it on
    with 78.7 GiB free), 8,192 fit without; on a 141 GB card the default fits; with 20 GiB nothing does."""
    s = ModelShape.from_hf_config(QWEN25_15B)
    h100 = int(78.7 * GiB)
    assert choose_gradient_checkpointing(s, 16384, h100).value is True
    half = choose_token_budget(s, 16384, 1536, h100)
    assert half.value == 8192 and choose_gradient_checkpointing(s, 8192, h100).value is False
    assert "16384 tokens would need recomputation" in half.reason, half.reason
    assert choose_token_budget(s, 16384, 1536, 139 * GiB).value == 16384
    none = choose_token_budget(s, 16384, 1536, 20 * GiB)
    assert none.value == 16384 and "down to 8192" in none.reason
    # never below the longest sequence: 12,288-token sequences keep a 16,384 budget (and recompute)
    assert choose_token_budget(s, 16384, 12288, h100).value == 16384
    # never below MIN_TOKEN_BUDGET: where 8,192 would not fit either, the default with recomputation (4,096
    # tokens without it measured slower than 16,384 with it)
    tight = choose_token_budget(s, 16384, 1536, h100, beside=30 * GiB)
    assert (
        tight.value == 16384 and choose_gradient_checkpointing(s, 8192, h100, beside=30 * GiB).value is True
    )
    assert choose_gradient_checkpointing(s, 4096, h100, beside=30 * GiB).value is False
    # a larger default halves as far as it fits: 32,768 -> 8,192 on the 80 GB card
    assert choose_token_budget(s, 32768, 1536, h100).value == 8192
