"""Tasks: seeded splits, the final-answer parser, rewards, user reward functions, safe scoring."""

from __future__ import annotations

import json
import time

import pytest

from tokencredit.data.tasks import (
    Example,
    RewardFnError,
    Task,
    extract_final_answer,
    list_tasks,
    load_reward_fn,
    make_task,
    math_reward,
    score_safely,
)

PROCEDURAL = ["add1", "add2", "mul1", "word", "mix", "chain"]


def _ex(answer: str, question: str = "What is 23 + 45?") -> Example:
    return Example(id="t", question=question, answer=answer, messages=({"role": "user", "content": question},))


# -- splits --------------------------------------------------------------------------------


def test_list_tasks_names_every_task():
    from tokencredit.data.controlled import CONTROLLED  # bench's tasks (tests/test_bench.py): train and eval share the space

    assert set(list_tasks()) == set(PROCEDURAL) | {"gsm8k", "math"} | set(CONTROLLED)


@pytest.mark.parametrize("name", PROCEDURAL)
def test_same_seed_same_task_and_disjoint_splits(name):
    a = make_task(name, seed=3, n_train=40, n_eval=12)
    b = make_task(name, seed=3, n_train=40, n_eval=12)
    assert a.train == b.train and a.eval == b.eval
    train_q = {e.question for e in a.train}
    eval_q = {e.question for e in a.eval}
    assert not train_q & eval_q
    assert len(train_q) == len(a.train) and len(eval_q) == len(a.eval)  # no duplicates inside a split
    assert len(a.eval) == 12 and len(a.train) == 40
    for e in a.train[:5] + a.eval[:5]:
        assert e.messages[-1] == {"role": "user", "content": e.question}
        assert a.reward(e.answer, e) == 1.0  # the reference answer scores


@pytest.mark.parametrize("name", ["add2", "word", "mix"])
def test_seed_changes_train_not_eval(name):
    a = make_task(name, seed=0, n_train=40, n_eval=12)
    b = make_task(name, seed=1, n_train=40, n_eval=12)
    assert a.eval == b.eval  # fixed eval split: seeds are compared on the same questions
    assert [e.question for e in a.train] != [e.question for e in b.train]


def test_small_space_is_capped_and_still_disjoint():
    t = make_task("add1", seed=0, n_train=512, n_eval=64)  # only 100 questions exist
    assert len(t.eval) == 50 and len(t.train) == 50
    assert not {e.question for e in t.train} & {e.question for e in t.eval}


def test_arithmetic_answers_are_right():
    for e in make_task("mul1", n_train=20, n_eval=4).train:
        a, b = [int(x) for x in e.question.split("?")[0].replace("What is ", "").split(" * ")]
        assert e.answer == str(a * b)


def test_chain_answers_shot_turn_and_worked_reward():
    t = make_task("chain", n_train=600, n_eval=8)
    exs = t.train + t.eval
    assert len(exs) == 455  # a + b - c > 0 over 2..9, less the worked example's question
    for e in exs:
        a, b, c = [int(x) for x in e.question.removeprefix("Compute ").rstrip(".").replace("-", "+").split(" + ")]
        assert e.answer == str(a + b - c) and a + b - c > 0
        # the worked example is a previous chat turn, the question is the last user message
        roles = [m["role"] for m in e.messages]
        assert roles == ["user", "assistant", "user"] and e.messages[0]["content"] != e.question
        assert "Answer: 2" in e.messages[1]["content"]
    e = exs[0]
    a, b, c = [int(x) for x in e.question.removeprefix("Compute ").rstrip(".").replace("-", "+").split(" + ")]
    right = f"Step 1: {a} + {b} = {a + b}\nStep 2: {a + b} - {c} = {a + b - c}\nAnswer: {a + b - c}"
    wrong_step = f"Step 1: {a} + {b} = {a + b + 1}\nStep 2: {a + b + 1} - {c} = {a + b + 1 - c}\nAnswer: {a + b + 1 - c}"
    assert t.reward(right, e) == 1.0 and t.reward(wrong_step, e) == 0.0


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="task name"):
        make_task("nope")
    with pytest.raises(ValueError, match="n_train"):
        make_task("add2", n_train=0)
    with pytest.raises(ValueError, match="path"):
        make_task("add2", path="x.jsonl")


# -- parser and reward ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("23 + 45 = 68", "68"),  # restated question: the final number, not the first
        ("What is 23 + 45? 23 + 45 = 68", "68"),
        ("The answer is 68.", "68"),
        ("The answer is 5 + 3 = 8.", "8"),
        ("The answer is 68. Check: 3 + 4 = 7", "68"),
        ("**Answer:** 68", "68"),
        ("68.0", "68"),
        ("\\boxed{68}", "68"),
        ("so \\boxed{68} and then 12", "68"),
        ("#### 1,234", "1234"),
        ("It is -12.", "-12"),
        ("The sum of 23 and 45 is 68.", "68"),
        ("He has $1,234.50 left", "1234.5"),
        ("no number here", None),
        ("", None),
        ("What is 23 + 45? Answer with just the number.", None),  # restated only: no answer
        ("0 + 5 =", None),  # truncated before the result: operands are not answers
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_reward_correct_and_incorrect():
    t = make_task("add2", n_train=4, n_eval=2)
    ex = _ex("68")
    assert t.reward("23 + 45 = 68", ex) == 1.0
    assert t.reward("The answer is 68.0.", ex) == 1.0
    assert t.reward("23 + 45 = 67", ex) == 0.0
    assert t.reward("What is 23 + 45?", ex) == 0.0
    assert t.reward("", ex) == 0.0


def test_math_reward_uses_math_verify_for_latex():
    pytest.importorskip("math_verify")
    assert math_reward("so the result is \\boxed{\\frac{1}{2}}", _ex("\\frac{1}{2}")) == 1.0
    assert math_reward("so the result is \\boxed{0.5}", _ex("\\frac{1}{2}")) == 1.0
    assert math_reward("so the result is \\boxed{\\frac{1}{3}}", _ex("\\frac{1}{2}")) == 0.0
    assert math_reward("#### 72", _ex("72")) == 1.0


# -- datasets from a local file ---------------------------------------------------------------


def test_gsm8k_from_local_jsonl(tmp_path):
    rows = [{"question": f"Sam has {i} apples and buys 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2:,}"}
            for i in range(998, 1018)]
    rows.append(rows[0])  # a duplicate must not end up in both splits
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = make_task("gsm8k", path=str(path), n_train=100, n_eval=5, seed=1)
    assert len(t.eval) == 5 and len(t.train) == 15
    assert not {e.question for e in t.train} & {e.question for e in t.eval}
    ex = next(e for e in t.train + t.eval if "has 998 apples" in e.question)
    assert ex.answer == "1000"  # "#### 1,000" -> 1000
    assert "998 apples" in ex.messages[-1]["content"]
    assert t.reward("998 + 2 = 1,000. The answer is \\boxed{1000}", ex) == 1.0
    assert t.reward("The answer is 999", ex) == 0.0
    assert make_task("gsm8k", path=str(path), n_train=100, n_eval=5, seed=1).train == t.train


def test_math_from_local_folder_with_solutions(tmp_path):
    (tmp_path / "train.jsonl").write_text(
        "\n".join(json.dumps({"problem": f"Compute {i}/2.", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$."})
                  for i in range(1, 7))
    )
    (tmp_path / "test.jsonl").write_text(json.dumps({"problem": "Compute 1/2.", "solution": "$\\boxed{\\frac{1}{2}}$"}))
    t = make_task("math", path=str(tmp_path), n_train=10, n_eval=4)
    assert [e.answer for e in t.eval] == ["\\frac{1}{2}"]
    assert len(t.train) == 5  # the test question is removed from train
    with pytest.raises(ValueError, match="path"):
        make_task("math", path=str(tmp_path / "missing.csv"))


# -- user reward functions -------------------------------------------------------------------


def length_reward(completion, example):
    return min(1.0, len(completion) / 10)


NOT_CALLABLE = 3


def one_arg(completion):
    return 1.0


def test_reward_fn_replaces_the_task_reward():
    t = make_task("add1", n_train=4, n_eval=2, reward_fn="test_tasks:length_reward")
    assert t.reward("12345", t.train[0]) == 0.5


def test_reward_fn_from_a_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(completion, example):\n    return 0.25\n")
    assert load_reward_fn(f"{f}:score")("x", None) == 0.25


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_colon", "expected 'package.module:function'"),
        ("surely_missing_pkg.mod:fn", "cannot import module 'surely_missing_pkg.mod'"),
        ("test_tasks:nope", "has no attribute 'nope'"),
        ("test_tasks:NOT_CALLABLE", "not callable"),
        ("test_tasks:one_arg", "must accept \\(completion, example\\)"),
    ],
)
def test_reward_fn_errors_are_named(spec, match):
    with pytest.raises(RewardFnError, match=match):
        load_reward_fn(spec)
    with pytest.raises(ValueError, match="reward_fn"):  # RewardFnError is a ValueError
        make_task("add1", n_train=2, n_eval=1, reward_fn=spec)


# -- score_safely ----------------------------------------------------------------------------


def _raises(completion, example):
    raise RuntimeError("boom")


def _sleeps(completion, example):
    time.sleep(1.0)
    return 1.0


def _raises_timeout(completion, example):
    raise TimeoutError("the reward's own timeout")


def test_score_safely_ok_error_timeout():
    ex = _ex("68")
    assert score_safely(lambda c, e: 0.75, "x", ex, 0.2) == (0.75, None)
    assert score_safely(_raises, "x", ex, 0.2) == (0.0, "error")
    assert score_safely(_raises_timeout, "x", ex, 0.2) == (0.0, "error")  # raised, not timed out
    assert score_safely(lambda c, e: float("nan"), "x", ex, 0.2) == (0.0, "error")
    assert score_safely(lambda c, e: "high", "x", ex, 0.2) == (0.0, "error")
    assert score_safely(_raises, "x", ex, None) == (0.0, "error")
    t0 = time.monotonic()
    assert score_safely(_sleeps, "x", ex, 0.2) == (0.0, "timeout")
    assert time.monotonic() - t0 < 0.8  # returned at the timeout, the thread was abandoned
    with pytest.raises(ValueError, match="timeout_s"):
        score_safely(_raises, "x", ex, 0)


def test_score_safely_runs_math_verify_in_a_thread():
    pytest.importorskip("math_verify")
    ex = _ex("\\frac{1}{2}")
    assert score_safely(math_reward, "\\boxed{\\frac{2}{4}}", ex, 10.0) == (1.0, None)


def test_task_is_a_plain_dataclass():
    t = Task(name="x", train=[], eval=[])
    assert t.reward("68", _ex("68")) == 1.0  # default scorer: numeric
    assert hash(_ex("1")) == hash(_ex("1"))


def test_mix_holds_every_part():
    t = make_task("mix", n_train=40, n_eval=8)
    assert {e.id.split("-")[0] for e in t.train} == {"add1", "add2", "mul1", "word"}
    assert {e.id.split("-")[0] for e in t.eval} == {"add1", "add2", "mul1", "word"}


# -- graders: math-verify for math, the numeric parser for the procedural tasks ------------------


def test_math_verify_misreads_a_restated_expression():
    """Why the procedural tasks keep the numeric final-answer parser: the model restates
    expressions after its answer, and math-verify takes the last expression of a completion."""
    from tokencredit.data.grading import math_verify_equal, numeric_reward

    text = "The answer is 12. Check: 3 + 4 = 7"
    assert not math_verify_equal("12", text)
    assert numeric_reward(text, _ex("12")) == 1.0


def test_dataset_tasks_grade_with_math_verify_only():
    """gsm8k / math / own data: math-verify decides (no numeric parser first)."""
    assert math_reward("The answer is 12. Check: 3 + 4 = 7", _ex("12")) == 0.0
    assert math_reward("so \\boxed{0.5}", _ex("\\frac{1}{2}")) == 1.0
    assert math_reward("She has 9*8=72 apples.", _ex("72")) == 1.0
