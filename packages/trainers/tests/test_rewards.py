"""Rule-based scorers, data_source dispatch, user reward functions and reward metrics."""

from __future__ import annotations

import sys
import textwrap

import pytest

from posttrain.trainers.rewards import (
    RewardConfig,
    RewardManager,
    default_compute_score,
    gsm8k,
    load_reward_fn,
    math_boxed,
    reward_metrics,
)


@pytest.mark.parametrize(
    "response,truth,want",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("first #### 3 then corrected #### 5", "5", 1.0),
        ("#### -7", "-7", 1.0),
        ("the answer is 72", "72", 0.0),
        ("#### 71", "72", 0.0),
        ("####72", "72", 0.0),
        ("#### 72.0", "72", 0.0),
    ],
)
def test_gsm8k_strict(response, truth, want):
    assert gsm8k.compute_score(response, truth) == want


def test_gsm8k_only_reads_the_last_300_characters_and_flexible_mode():
    assert gsm8k.compute_score("#### 72" + " filler" * 60, "72") == 0.0
    assert gsm8k.compute_score("so it is 3, no wait, 72.", "72", method="flexible") == 0.0
    assert gsm8k.extract_solution("so it is 3, no wait, 72", method="flexible") == "72"
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="strict or flexible"):
        gsm8k.extract_solution("x", method="loose")


@pytest.mark.parametrize(
    "response,truth",
    [
        (r"so the answer is $\boxed{\frac{3}{4}}$.", "3/4"),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34"),
        (r"\boxed{0.75}", r"\frac{3}{4}"),
        (r"\boxed{7.0}", "7"),
        (r"\boxed{ 1,000 }", "1000"),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{\sqrt3}", r"\sqrt{3}"),
        (r"\boxed{10\text{ cm}}", "10"),
        (r"first \boxed{2} then \boxed{\frac{1}{2}}", "0.5"),
        (r"\fbox{-4}", "-4"),
        (r"\boxed 9$ done", "9"),
        (r"\boxed{\frac{1}{2}}", r"\boxed{0.5}"),
    ],
)
def test_math_equivalent_answers_score_one(response, truth):
    assert math_boxed.compute_score(response, truth) == 1.0


@pytest.mark.parametrize(
    "response,truth",
    [
        (r"\boxed{\frac{3}{5}}", "3/4"),
        (r"\boxed{7.01}", "7"),
        (r"the answer is 7", "7"),
        (r"\boxed{(1,3)}", "(1,2)"),
        (r"\boxed{x^2", "x^2"),
        (r"\boxed{\frac{1}{0}}", "1/0x"),
    ],
)
def test_math_wrong_or_missing_answers_score_zero(response, truth):
    assert math_boxed.compute_score(response, truth) == 0.0


def test_math_helpers():
    assert math_boxed.last_boxed_only_string(r"a \boxed{\frac{1}{2}} b") == r"\boxed{\frac{1}{2}}"
    assert math_boxed.remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert math_boxed.strip_string(r"\frac12") == r"\frac{1}{2}"
    assert math_boxed.strip_string(r"\tfrac1{72}") == r"\frac{1}{72}"
    assert math_boxed.as_number("-2.50") == math_boxed.as_number(r"-\frac{5}{2}")
    assert math_boxed.as_number("x+1") is None


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 4", "4") == 1.0
    assert default_compute_score("synthetic_arithmetic", "12 + 30 = 42\n#### 42", "42") == 1.0
    assert default_compute_score("synthetic_arithmetic", "12 + 30 = 42\n#### 41", "42") == 0.0
    assert default_compute_score("lighteval/MATH", r"\boxed{4}", "4") == 1.0
    assert default_compute_score("HuggingFaceH4/MATH-500", r"\boxed{4}", "4.0") == 1.0
    assert default_compute_score("aime2024", r"\boxed{4}", "4") == 1.0
    with pytest.raises(ValueError, match="custom_reward_function"):
        default_compute_score("my/unknown", "x", "y")


def test_custom_reward_function_from_module_and_file(tmp_path, monkeypatch):
    code = textwrap.dedent("""
        def length_reward(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
            return {"score": scale * len(solution_str), "source": data_source}

        def flag(data_source, solution_str, ground_truth, extra_info=None):
            return solution_str == ground_truth

        NOT_CALLABLE = 3
    """)
    (tmp_path / "my_rewards_mod.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("my_rewards_mod:length_reward")
    assert fn("s", "abc", "x")["score"] == 3.0
    from_file = load_reward_fn(f"{tmp_path / 'my_rewards_mod.py'}:flag")
    assert from_file("s", "a", "a") is True
    manager = RewardManager(
        RewardConfig(custom_reward_function="my_rewards_mod:length_reward", reward_kwargs={"scale": 0.5})
    )
    result = manager(["a", "b"], ["xy", "wxyz"], ["", ""])
    assert result.scores == [1.0, 2.0] and result.extras == {"source": ["a", "b"]}
    assert RewardManager(RewardConfig(custom_reward_function="my_rewards_mod:flag"))(
        ["a", "a"], ["1", "2"], ["1", "1"]
    ).scores == [1.0, 0.0]
    sys.modules.pop("my_rewards_mod", None)


@pytest.mark.parametrize(
    "target,match",
    [
        ("no_colon_here", "module:function"),
        ("surely_not_a_module_xyz:fn", "cannot be imported"),
        ("json:no_such_function", "not defined"),
        ("json:__version__", "not a function"),
        ("/nonexistent/dir/rew.py:fn", "does not exist"),
    ],
)
def test_custom_reward_function_errors(target, match):
    with pytest.raises(ValueError, match=match):
        load_reward_fn(target)


def test_rule_manager_and_bad_scores(tmp_path):
    manager = RewardManager(RewardConfig())
    result = manager(["synthetic_arithmetic", "lighteval/MATH"], ["#### 5", r"\boxed{2}"], ["5", "3"])
    assert result.scores == [1.0, 0.0] and result.extras == {}
    with pytest.raises(ValueError, match="differ in length"):
        manager(["gsm8k"], ["a", "b"], ["1"])
    (tmp_path / "bad_rew.py").write_text(
        "def f(*a, **k):\n    return {'acc': 1}\n\ndef g(*a, **k):\n    return 'x'\n"
    )
    with pytest.raises(ValueError, match="without 'score'"):
        RewardManager(RewardConfig(custom_reward_function=f"{tmp_path}/bad_rew.py:f"))(["s"], ["x"], ["y"])
    with pytest.raises(ValueError, match="finite number"):
        RewardManager(RewardConfig(custom_reward_function=f"{tmp_path}/bad_rew.py:g"))(["s"], ["x"], ["y"])


def test_reward_metrics():
    scores = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    m = reward_metrics(scores, ["a", "a", "a", "b", "b", "b"], uids=[0, 0, 0, 1, 1, 2])
    assert m["reward/mean"] == pytest.approx(1 / 3) and m["reward/min"] == 0.0 and m["reward/max"] == 1.0
    assert m["reward/std"] == pytest.approx((2 / 9) ** 0.5)
    assert m["reward/positive_frac"] == pytest.approx(1 / 3)
    assert m["reward/a/mean"] == pytest.approx(1 / 3) and m["reward/b/mean"] == pytest.approx(1 / 3)
    assert m["reward/group_any_positive"] == pytest.approx(2 / 3)
    assert m["reward/group_all_same"] == pytest.approx(2 / 3)
    assert reward_metrics([]) == {}
    assert "reward/a/mean" not in reward_metrics([1.0], ["a"])


def test_numeric_reward_extras_become_means_and_others_are_left_out():
    from posttrain.trainers.rl.step_metrics import extra_means

    extras = {"acc": [1.0, 0.0, None, True], "note": ["a", "b", None, None], "len": [None, None, None, None]}
    assert extra_means(extras) == {"reward/extra/acc/mean": 2 / 3}
