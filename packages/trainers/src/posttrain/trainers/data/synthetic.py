"""Synthetic tasks a tiny model can learn in minutes on a CPU, in the SFT and RL column layouts.

``largest``: "Which is the largest of a, b, c?" over single digits (1,000 ordered triples); the answer names
it and ends with ``#### <max>``. A tiny model learns the comparison as a rule, so held-out triples score like
training ones: the demo's task, where RL gains on the training prompts show up on the test set.

``arithmetic``: "What is a + b?" with ``digits``-digit operands; the answer restates the sum and ends with
``#### <sum>`` (the GSM8K convention the rule reward reads). Each row carries both layouts: ``messages`` (a
user/assistant chat for SFT) and verl's RL columns ``data_source``, ``prompt`` (the user turn as a chat list),
``ability``, ``reward_model`` ({style, ground_truth}) and ``extra_info``. ``calculator``: "What is a * b?"
over 2-digit numbers, beyond what a tiny model can multiply; the SFT ``messages`` are tool-use traces (a
``calculator`` call, the tool's result, ``#### <product>``) and the RL rows are played in the ``calculator``
environment (posttrain-envs). Rows come from a seeded ``random.Random``, so the same seed gives the same
files; test rows never repeat a training question.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

DATA_SOURCE = "synthetic_arithmetic"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
LARGEST_SOURCE = "synthetic_largest"
LARGEST_INSTRUCTION = 'Output the final answer after "####".'
CALCULATOR_SOURCE = "synthetic_calculator"
CALCULATOR_INSTRUCTION = 'Use the calculator, then output the final answer after "####".'
TASKS = ("arithmetic", "largest", "calculator")


def arithmetic_example(a: int, b: int) -> tuple[str, str, str]:
    """(question, full answer, ground truth) for ``a + b``."""
    total = a + b
    return f"What is {a} + {b}?", f"{a} + {b} = {total}\n#### {total}", str(total)


def make_row(
    question: str,
    answer: str,
    truth: str,
    *,
    data_source: str,
    ability: str,
    instruction: str,
    split: str,
    index: int,
) -> dict[str, Any]:
    """One row with both the SFT chat and verl's RL columns."""
    user = f"{question} {instruction}".strip()
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": user}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
    }


def arithmetic_rows(
    num_train: int, num_test: int, *, digits: int = 2, seed: int = 0
) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}`` of distinct additions of ``digits``-digit numbers."""
    if digits < 1:
        raise ValueError(f"digits={digits} must be >= 1")
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    space = (high - low + 1) ** 2
    if num_train + num_test > space:
        raise ValueError(
            f"num_train + num_test = {num_train + num_test} exceeds the {space} distinct "
            f"{digits}-digit additions: lower them or raise --digits"
        )
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < num_train + num_test:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    out: dict[str, list[dict]] = {"train": [], "test": []}
    for i, (a, b) in enumerate(pairs):
        split = "train" if i < num_train else "test"
        q, ans, truth = arithmetic_example(a, b)
        out[split].append(
            make_row(
                q,
                ans,
                truth,
                data_source=DATA_SOURCE,
                ability="math",
                instruction=INSTRUCTION,
                split=split,
                index=len(out[split]),
            )
        )
    return out


def largest_rows(num_train: int, num_test: int, *, seed: int = 0) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}`` of distinct digit triples (the test triples never appear in
    training)."""
    if num_train + num_test > 1000:
        raise ValueError(
            f"num_train + num_test = {num_train + num_test} exceeds the 1000 digit triples: lower them"
        )
    triples = [(a, b, c) for a in range(10) for b in range(10) for c in range(10)]
    random.Random(seed).shuffle(triples)
    out: dict[str, list[dict]] = {"train": [], "test": []}
    for i, t in enumerate(triples[: num_train + num_test]):
        split = "train" if i < num_train else "test"
        m = max(t)
        question = f"Which is the largest of {t[0]}, {t[1]}, {t[2]}?"
        out[split].append(
            make_row(
                question,
                f"The largest is {m}.\n#### {m}",
                str(m),
                data_source=LARGEST_SOURCE,
                ability="logic",
                instruction=LARGEST_INSTRUCTION,
                split=split,
                index=len(out[split]),
            )
        )
    return out


def calculator_call(expression: str) -> str:
    """The Hermes-format call of the ``calculator`` tool that the SFT traces teach."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def calculator_rows(
    num_train: int, num_test: int, *, seed: int = 0, products: int = 1
) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}`` of distinct sums of ``products`` products of two 2-digit numbers,
    whose ``messages`` are tool-use traces: the user's question, one ``calculator`` call per product (and one
    for the sum when there are several), each with the tool's result, then the answer after ``####``.
    ``products=1``:
    "What is 47 * 83?" in 2 assistant turns; ``products=2``: "What is 47 * 83 + 12 * 34?" in 4."""
    if products < 1:
        raise ValueError(f"products={products} must be >= 1")
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng = random.Random(seed)
    if products == 1:
        if num_train + num_test > len(pairs):
            raise ValueError(
                f"num_train + num_test = {num_train + num_test} exceeds the {len(pairs)} products"
            )
        rng.shuffle(pairs)
        questions = [[p] for p in pairs[: num_train + num_test]]
    else:
        seen: set[tuple] = set()
        while len(seen) < num_train + num_test:
            seen.add(tuple(rng.choice(pairs) for _ in range(products)))
        questions = sorted(seen, key=lambda _: rng.random())
    out: dict[str, list[dict]] = {"train": [], "test": []}
    for i, terms in enumerate(questions):
        split = "train" if i < num_train else "test"
        parts = [f"{a} * {b}" for a, b in terms]
        values = [str(a * b) for a, b in terms]
        steps = list(zip(parts, values))
        if products > 1:
            steps.append((" + ".join(values), str(sum(a * b for a, b in terms))))
        answer = steps[-1][1]
        row = make_row(
            f"What is {' + '.join(parts)}?",
            f"#### {answer}",
            answer,
            data_source=CALCULATOR_SOURCE,
            ability="tool_use",
            instruction=CALCULATOR_INSTRUCTION,
            split=split,
            index=len(out[split]),
        )
        row["messages"][1:] = [
            *(
                m
                for expression, value in steps
                for m in (
                    {"role": "assistant", "content": calculator_call(expression)},
                    {"role": "tool", "content": value},
                )
            ),
            {"role": "assistant", "content": f"#### {answer}"},
        ]
        out[split].append(row)
    return out


def synthetic_rows(
    task: str, num_train: int, num_test: int, *, digits: int = 2, seed: int = 0
) -> dict[str, list[dict]]:
    """Rows of ``task`` (one of :data:`TASKS`)."""
    if task == "largest":
        return largest_rows(num_train, num_test, seed=seed)
    if task == "arithmetic":
        return arithmetic_rows(num_train, num_test, digits=digits, seed=seed)
    if task == "calculator":
        return calculator_rows(num_train, num_test, seed=seed)
    raise ValueError(f"synthetic task {task!r} is unknown: choose one of {', '.join(TASKS)}")


def tokenizer_corpus(num_lines: int = 4000, seed: int = 0) -> Iterator[str]:
    """Text a tiny tokenizer is trained on: arithmetic chats plus plain English and markup."""
    rng = random.Random(seed)
    words = (
        "the answer is what think step by step and output final after let us a number sum plus minus "
        "question user assistant system you are helpful solve problem total each how many more than "
        "boxed equals times of to in for with result so we have then"
    ).split()
    for i in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        q, ans, _ = arithmetic_example(a, b)
        yield f"{q} {INSTRUCTION}\n{ans}"
        yield (
            " ".join(rng.choice(words) for _ in range(12))
            + (". " if i % 2 else "? ")
            + "\\boxed{"
            + str(a)
            + "}"
        )
