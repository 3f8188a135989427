"""Datasets: chat tokenisation and loss masks, truncation, parquet checks, the resumable sampler,
converters."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sft_fixtures import make_arithmetic, make_tiny_model
from transformers import AutoTokenizer

from posttrain.trainers.commands import data_cmd
from posttrain.trainers.data.chat import tokenize_chat
from posttrain.trainers.data.config import DataConfig
from posttrain.trainers.data.convert import convert, last_boxed, read_records
from posttrain.trainers.data.sampler import StatefulSampler, rank_slice
from posttrain.trainers.data.sft_dataset import SFTDataset


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("model")))


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5\n#### 5"},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "#### 2"},
]


def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer):
    ids, mask = tokenize_chat(tokenizer, CHAT)
    assert len(ids) == len(mask)
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(ids) == full
    target_text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert target_text == "2 + 3 = 5\n#### 5<|im_end|>\n#### 2<|im_end|>\n"
    # the prompt part ends with the assistant header, as a rollout prompt would
    first = mask.index(1.0)
    assert tokenizer.decode(ids[:first]).endswith("<|im_start|>assistant\n")


def _write(path, table):
    pq.write_table(table, path)
    return str(path)


def test_truncation_error_names_row_and_length(tokenizer, tmp_path):
    long = [{"role": "user", "content": "1 " * 100}, {"role": "assistant", "content": "ok"}]
    path = _write(tmp_path / "d.parquet", pa.Table.from_pylist([{"messages": CHAT}, {"messages": long}]))
    with pytest.raises(ValueError, match=r"d\.parquet row 1 has \d+ tokens, more than data\.max_length=96"):
        SFTDataset([path], tokenizer, DataConfig(max_length=96))
    right = SFTDataset([path], tokenizer, DataConfig(max_length=96, truncation="right"))
    left = SFTDataset([path], tokenizer, DataConfig(max_length=96, truncation="left"))
    full_ids, _ = tokenize_chat(tokenizer, long)
    assert right.input_ids[1] == full_ids[:96] and left.input_ids[1] == full_ids[-96:]
    assert left.loss_mask[1][0] == 0.0 and sum(left.loss_mask[1]) > 0


@pytest.mark.parametrize("case", ["missing", "wrong_type", "empty", "not_parquet"])
def test_malformed_parquet_names_file_and_column(tokenizer, tmp_path, case):
    path = tmp_path / f"{case}.parquet"
    if case == "missing":
        _write(path, pa.table({"chat": [json.dumps(CHAT)]}))
        match = r"missing\.parquet: column 'messages' is missing"
    elif case == "wrong_type":
        _write(path, pa.table({"messages": ["just a string"]}))
        match = r"wrong_type\.parquet: column 'messages' has type string, expected list<struct<role"
    elif case == "empty":
        _write(path, pa.Table.from_pylist([], schema=pa.table({"messages": [CHAT]}).schema))
        match = r"empty\.parquet: the file has no rows"
    else:
        path.write_bytes(b"")
        match = r"not_parquet\.parquet: not a readable parquet file"
    with pytest.raises(ValueError, match=match):
        SFTDataset([str(path)], tokenizer, DataConfig())


def test_chat_without_assistant_is_rejected(tokenizer, tmp_path):
    path = _write(tmp_path / "a.parquet", pa.Table.from_pylist([{"messages": CHAT[:2]}]))
    with pytest.raises(ValueError, match=r"a\.parquet row 0: no assistant message"):
        SFTDataset([path], tokenizer, DataConfig())


def test_sampler_epochs_cover_every_sample_once_and_reshuffle():
    s = StatefulSampler(10, 3, shuffle=True, seed=7)
    epochs: dict[int, list[int]] = {}
    for _ in range(6):
        e, idx = s.next_batch()
        epochs.setdefault(e, []).extend(idx)
    assert sorted(epochs) == [0, 1] and all(len(set(v)) == 9 for v in epochs.values())
    assert epochs[0] != epochs[1]
    assert StatefulSampler(10, 3, seed=7).order(0) == s.order(0) != StatefulSampler(10, 3, seed=8).order(0)


def test_sampler_resume_continues_with_next_unseen_batch():
    full = StatefulSampler(20, 4, seed=3)
    expected = [full.next_batch() for _ in range(12)]
    first = StatefulSampler(20, 4, seed=3)
    seen = [first.next_batch() for _ in range(7)]  # stops mid epoch 1
    resumed = StatefulSampler(20, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert seen + [resumed.next_batch() for _ in range(5)] == expected
    with pytest.raises(ValueError, match="batch_size=4 but this run has 5"):
        StatefulSampler(20, 5, seed=3).load_state_dict(first.state_dict())


def test_rank_slice_partitions_the_global_batch():
    idx = [5, 1, 9, 3, 7, 2]
    assert rank_slice(idx, 0, 2) + rank_slice(idx, 1, 2) == idx
    with pytest.raises(ValueError, match="multiple of 4"):
        rank_slice(idx, 0, 4)


def test_synthetic_command_writes_sft_and_rl_columns(tmp_path):
    assert (
        data_cmd.main(
            [
                "synthetic",
                "--task",
                "arithmetic",
                "--out",
                str(tmp_path),
                "--num-train",
                "50",
                "--num-test",
                "10",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    train, test = pq.read_table(tmp_path / "train.parquet"), pq.read_table(tmp_path / "test.parquet")
    assert train.num_rows == 50 and test.num_rows == 10
    row = train.slice(0, 1).to_pylist()[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info", "messages"}
    assert row["data_source"] == "synthetic_arithmetic" and row["reward_model"]["style"] == "rule"
    a, b = (int(x) for x in row["extra_info"]["question"].removeprefix("What is ").rstrip("?").split(" + "))
    assert row["reward_model"]["ground_truth"] == str(a + b)
    assert row["messages"][-1]["content"].endswith(f"#### {a + b}")
    questions = {r["extra_info"]["question"] for r in train.to_pylist()}
    assert not questions & {r["extra_info"]["question"] for r in test.to_pylist()}


def test_gsm8k_and_math_conversion_from_local_files(tmp_path):
    gsm = tmp_path / "gsm8k_test.jsonl"
    gsm.write_text(
        json.dumps(
            {
                "question": "Tom has 3 apples and buys 1,200 more. How many?",
                "answer": "3 + 1200 = <<3+1200=1203>>1203\n#### 1,203",
            }
        )
        + "\n"
    )
    math = tmp_path / "math.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.",
                    "level": "Level 1",
                    "type": "Algebra",
                    "solution": "It is $\\boxed{\\frac{2}{2}}=\\boxed{1}$.",
                }
            ]
        ),
        math,
    )
    assert data_cmd.main(["gsm8k", "--input", str(gsm), "--out", str(tmp_path / "g")]) == 0
    assert data_cmd.main(["math", "--input", str(math), "--out", str(tmp_path / "m")]) == 0
    g = pq.read_table(tmp_path / "g" / "test.parquet").to_pylist()[0]
    m = pq.read_table(tmp_path / "m" / "train.parquet").to_pylist()[0]
    assert g["reward_model"]["ground_truth"] == "1203" and g["data_source"] == "openai/gsm8k"
    assert m["reward_model"]["ground_truth"] == "1" and "\\boxed{}" in m["prompt"][0]["content"]
    assert last_boxed("a \\boxed{x^{2}} b") == "x^{2}" and last_boxed("none") is None
    with pytest.raises(ValueError, match=r"row 0: missing or non-string field\(s\) \['answer'\]"):
        convert("gsm8k", [{"question": "q"}], "train", path="in.jsonl")
    assert len(read_records(gsm)) == 1


def test_synthetic_data_loads_as_sft_dataset(tokenizer, tmp_path):
    train, _ = make_arithmetic(tmp_path, num_train=20, num_test=4)
    ds = SFTDataset([str(train)], tokenizer, DataConfig(max_length=128))
    batch = ds.batch([0, 3, 5])
    assert batch.num_seqs == 3 and batch.num_tokens == ds.num_tokens([0, 3, 5])
    assert all(0 < sum(m) < len(m) for m in ds.loss_mask)


def _rl_row(truth, source="synthetic_arithmetic") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "reward_model": {"style": "rule", "ground_truth": truth},
    }


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (_rl_row(None), r"b\.parquet row 1: reward_model\.ground_truth is null"),
        ({**_rl_row("5"), "reward_model": None}, r"b\.parquet row 1: reward_model\.ground_truth is null"),
        (_rl_row("5", source=None), r"b\.parquet row 1: data_source is null"),
        ({**_rl_row("5"), "prompt": []}, r"b\.parquet row 1: the prompt chat 'prompt' is empty"),
    ],
)
def test_rl_rows_with_null_reward_fields_are_rejected_with_file_and_row(tokenizer, tmp_path, row, match):
    from posttrain.trainers.rl.dataset import PromptDataset

    good = _write(tmp_path / "a.parquet", pa.Table.from_pylist([_rl_row("5"), _rl_row("7")]))
    bad = _write(tmp_path / "b.parquet", pa.Table.from_pylist([_rl_row("5"), row]))
    config = DataConfig(max_prompt_length=64)
    assert [p.ground_truth for p in PromptDataset([good], tokenizer, config)] == ["5", "7"]
    with pytest.raises(ValueError, match=match):
        PromptDataset([good, bad], tokenizer, config)


def test_prompt_length_follows_the_rollout_and_a_mismatch_is_rejected(tokenizer, tmp_path):
    from posttrain.trainers.rl.dataset import PromptDataset

    assert DataConfig().prompt_length(64) == 64
    assert DataConfig(max_prompt_length=64).prompt_length(64) == 64
    with pytest.raises(
        ValueError,
        match=r"data\.max_prompt_length=100 differs from rollout\.prompt_length=64: .*"
        r"set rollout\.prompt_length=100",
    ):
        DataConfig(max_prompt_length=100).prompt_length(64)
    path = _write(tmp_path / "p.parquet", pa.Table.from_pylist([_rl_row("5")]))
    with pytest.raises(ValueError, match="data.max_prompt_length is unset"):
        PromptDataset([path], tokenizer, DataConfig())
    with pytest.warns(UserWarning, match=r"dropped 1 of 2 prompts longer than data\.max_prompt_length=30"):
        long = {**_rl_row("5"), "prompt": [{"role": "user", "content": "1 " * 50}]}
        two = _write(tmp_path / "two.parquet", pa.Table.from_pylist([_rl_row("5"), long]))
        assert len(PromptDataset([two], tokenizer, DataConfig(max_prompt_length=30))) == 1


@pytest.mark.parametrize("products", [1, 2])
def test_calculator_traces_call_the_tool_and_answer_its_result(products):
    from posttrain.core.env import Turn
    from posttrain.envs.calculator import CalculatorEnv, calculator, final_answer
    from posttrain.trainers.agents.parsers import make_parser
    from posttrain.trainers.data.synthetic import calculator_rows
    from posttrain.trainers.rewards.score import default_compute_score

    splits = calculator_rows(30, 10, seed=1, products=products)
    questions = [r["extra_info"]["question"] for s in ("train", "test") for r in splits[s]]
    assert len(set(questions)) == 40 and all(q.count("*") == products for q in questions)
    parser = make_parser("hermes")
    for row in splits["train"]:
        messages, truth = row["messages"], row["reward_model"]["ground_truth"]
        turns = messages[1::2]
        assert len(turns) == (2 if products == 1 else products + 2)
        for call_turn, tool in zip(turns, messages[2::2]):
            (call,) = parser.parse(call_turn["content"]).calls
            assert tool["role"] == "tool" and tool["content"] == calculator(**call.arguments)
        env = CalculatorEnv()
        env.reset({"prompt": row["prompt"], "ground_truth": truth})
        assert env.step(Turn(turns[-1]["content"])).reward == 1.0
        assert final_answer(turns[-1]["content"]) == truth
        assert default_compute_score(row["data_source"], turns[-1]["content"], truth) == 1.0
    with pytest.raises(ValueError, match="products=0"):
        calculator_rows(1, 1, products=0)
