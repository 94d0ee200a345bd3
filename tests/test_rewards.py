"""Rewards: answer extraction, math-verify equality (also off the main thread), the format
reward, and compute_rewards' errors."""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jetrl.rewards import (
    RewardError,
    compute_rewards,
    extract_answer,
    format_reward,
    get_reward_func,
    math_reward,
    resolve_reward_funcs,
)

MATH_CASES = [  # (completion, gold, reward)
    (r"So the total is \boxed{72}.", "72", 1.0),
    (r"\boxed{71}", "72", 0.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    (r"\boxed{1,000}", "1,000", 1.0),
    ("The answer is 1,000", "1000", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("3/4", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{2}{3}}", "0.5", 0.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"First \boxed{3}, no wait: \boxed{5}", "5", 1.0),  # the last box is the answer
    (r"First \boxed{5}, no wait: \boxed{3}", "5", 0.0),
    ("I am not sure.", "5", 0.0),  # no answer at all
    ("", "5", 0.0),
    (r"\boxed{}", "5", 0.0),
    (r"It is \boxed{12", "12", 0.0),  # cut inside its box: the digits there may be half an answer (\boxed{125})
    (r"so \boxed{\frac{1}{2", "2", 0.0),
    (r"\boxed{72}", "72.", 1.0),  # a gold answer is cleaned as a prediction is
    ("The answer is $\\frac{3}{4}$", "3/4", 1.0),  # a LaTeX fraction is one number
    ("The answer is $\\frac{3}{4}$", "4", 0.0),
    ("So x = .5", "0.5", 1.0),
    ("The answer is \u22125", "-5", 1.0),  # Unicode minus
    ("#### Final Answer\nThe total is 81", "81", 1.0),  # a markdown heading is not a #### answer
    (r"\boxed{1\,000}", "1000", 1.0),  # thin space between digit groups
    (r"\boxed{1\,000}", "0", 0.0),
    (r"\boxed{1 000}", "1000", 1.0),
    ("so it is 2^{10}", "10", 0.0),  # a power is one number, not its exponent
    ("so it is 2^{10}", "1024", 1.0),
    ("x^2 = 4", "4", 1.0),
    ("81", "81", 1.0),  # tiny-model style bare answer
    ("-4", "-4", 1.0),
    ("The answer is 4.", "-4", 0.0),
    (r"\boxed{72}", "She earns 9 * 8 = 72.\n#### 72", 1.0),  # GSM8K-style gold solution
]


@pytest.mark.parametrize("completion,gold,expected", MATH_CASES)
def test_math_reward_table(completion, gold, expected):
    assert math_reward([completion], ground_truth=[gold]) == [expected]


def test_math_reward_reads_answer_column_and_messages():
    conversational = [[{"role": "assistant", "content": r"\boxed{9}"}]]
    assert math_reward(conversational, answer=["9"]) == [1.0]
    with pytest.raises(ValueError, match="gold-answer column"):
        math_reward([r"\boxed{9}"], prompt=["x"])
    # per sample, the first gold column that is not None (a ground_truth column built from answer-only records)
    assert math_reward([r"\boxed{None}", r"\boxed{5}"], ground_truth=[None, None], answer=["7", "5"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="sample 1 has no gold answer"):
        math_reward([r"\boxed{1}", r"\boxed{2}"], ground_truth=["1", None])


def test_correctness_is_full_credit_from_the_tasks_answer_reward():
    from jetrl.rewards import correctness_func, is_correct, reasoning_gym_reward

    assert correctness_func(["format", "reasoning_gym"]) is reasoning_gym_reward
    assert correctness_func(["format", "math", "reasoning_gym"]) is math_reward
    assert correctness_func(["format", lambda completions, **kw: [0.0]]) is math_reward
    assert [is_correct(r) for r in (1.0, 0.99, 0.05, 0.0, None, float("nan"))] == [True] + [False] * 5


def test_math_reward_from_worker_threads():
    completions, golds = [c for c, _, _ in MATH_CASES], [g for _, g, _ in MATH_CASES]
    expected = [r for _, _, r in MATH_CASES]

    def score():
        assert threading.current_thread() is not threading.main_thread()
        return math_reward(completions, ground_truth=golds)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = [f.result() for f in [pool.submit(score) for _ in range(2)]]
    assert results == [expected, expected]


@pytest.mark.parametrize("text,number_fallback,expected", [
    (r"a \boxed{\frac{1}{\sqrt{2}}} b", True, r"\frac{1}{\sqrt{2}}"),
    ("x\n#### 42 \nmore text 7", True, "42"),
    ("we get 5 then 1,234.5", True, "1,234.5"),
    ("we get 5 then 6", False, None),
    (r"$\boxed{$7$}$.", True, "7"),
])
def test_extract_answer(text, number_fallback, expected):
    assert extract_answer(text, number_fallback=number_fallback) == expected


@pytest.mark.parametrize("completion,expected", [
    (r"Reasoning... so \boxed{42}.", 1.0),
    (r"\boxed{\frac{1}{2}}", 1.0),
    ("42", 0.0),
    ("#### 42", 0.0),
    (r"\boxed{1} or \boxed{2}", 0.0),
    (r"\boxed{ }", 0.0),
    (r"\boxed{42", 0.0),
    (r"\boxed{4} and \boxed{2", 0.0),
])
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


def test_compute_rewards_by_name_and_callable():
    def length_penalty(completions, **kwargs):
        return [None if c == "" else -0.1 for c in completions]

    out = compute_rewards(["math", "format", length_penalty], [r"\boxed{3}", "2", ""], ground_truth=["3", "3", "3"])
    assert list(out) == ["math", "format", "length_penalty"]
    assert out["math"] == [1.0, 0.0, 0.0] and out["format"] == [1.0, 0.0, 0.0]
    assert out["length_penalty"][:2] == [-0.1, -0.1] and math.isnan(out["length_penalty"][2])


def test_reward_that_raises_names_function_and_sample():
    def picky(completions, ground_truth, **kwargs):
        return [1.0 / int(c) for c in completions]

    with pytest.raises(RewardError, match=r"reward function 'picky' raised on sample 2: ZeroDivisionError") as info:
        compute_rewards([picky], ["1", "2", "0", "0"], ground_truth=["1"] * 4)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_reward_gets_only_the_columns_it_names_without_kwargs():
    def exact(completions, ground_truth):
        return [float(c == g) for c, g in zip(completions, ground_truth)]

    out = compute_rewards([exact], ["1", "2"], ground_truth=["1", "1"], level=[3, 4], prompts=["p", "q"])
    assert out == {"exact": [1.0, 0.0]}
    with pytest.raises(RewardError, match=r"'exact' raised on sample 0: TypeError: .*ground_truth"):
        compute_rewards([exact], ["1"], level=[3])

    def trl_style(prompts, completions, completion_ids, **kwargs):  # TRL calls everything by keyword
        return [float(len(ids)) for ids in completion_ids]

    def texts_first(texts, answer):  # completions go to the first parameter; a column of that name does not
        return [float(t == a) for t, a in zip(texts, answer)]

    def outputs_first(outputs, **kwargs):  # any name for the completions, the columns by keyword
        return [float(o == a) for o, a in zip(outputs, kwargs["answer"])]

    columns = {"prompts": ["p", "q"], "completion_ids": [[1], [2, 3]], "answer": ["1", "x"], "texts": ["?", "?"]}
    assert compute_rewards([trl_style, texts_first, outputs_first], ["1", "2"], **columns) == {
        "trl_style": [1.0, 2.0], "texts_first": [1.0, 0.0], "outputs_first": [1.0, 0.0]}


def test_reward_missing_column_fails_at_sample_0():
    with pytest.raises(RewardError, match=r"'math' raised on sample 0: ValueError: .*gold-answer column"):
        compute_rewards("math", [r"\boxed{1}"])


@pytest.mark.parametrize("bad,match", [
    (lambda completions, **kw: [1.0], "returned 1 rewards for 2 completions"),
    (lambda completions, **kw: 1.0, "returned float"),
    (lambda completions, **kw: [1.0, "high"], "non-number at sample 1"),
])
def test_reward_bad_output(bad, match):
    with pytest.raises(RewardError, match=match):
        compute_rewards({"bad": bad}, ["a", "b"])


def test_registry_errors():
    with pytest.raises(ValueError, match=r"unknown reward function 'acc': choose one of math, format"):
        get_reward_func("acc")
    with pytest.raises(ValueError, match="given twice"):
        resolve_reward_funcs(["math", "math"])
    with pytest.raises(ValueError, match="column 'ground_truth' has 1 values for 2 completions"):
        compute_rewards("math", ["a", "b"], ground_truth=["1"])


def test_evaluate_counts_full_credit_of_the_given_answer_reward():
    """Held-out pass@k counts a sample correct on full credit only (a reasoning-gym scorer's 0.05 for a wrong answer
    in the right form is not a pass), scored by the task's answer reward."""
    from jetrl.engine import Completion
    from jetrl.run.evaluate import evaluate

    class Engine:
        def generate(self, prompt_ids, params, seeds=None):
            return [[Completion([1], [0.0], "stop", None, text) for text in ("a", "b", "c", "d")]]

    def graded(completions, **kwargs):
        return [{"a": 1.0, "b": 0.05, "c": None, "d": 0.0}[c] for c in completions]

    result = evaluate(Engine(), [[1]], [{"ground_truth": "x"}], max_tokens=1, num_samples=4, temperature=1.0,
                      correct_func=graded)
    assert result["pass@1"] == 0.25 and result["pass@4"] == 1.0
