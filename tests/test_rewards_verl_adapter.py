"""The verl custom_reward_function adapter (tokencredit/integrations/verl/rewards.py), called the
way verl's NaiveRewardManager calls compute_score: loaded by its file path, reward_kwargs merged
in (verl's _call_with_kwargs), one call per response with data_source, solution_str,
ground_truth and extra_info. verl itself is not imported or run."""

from __future__ import annotations

import importlib.util
import math
from functools import partial
from pathlib import Path

import pytest

import tokencredit

ADAPTER = Path(tokencredit.__file__).parent / "integrations" / "verl" / "rewards.py"


def _text(c):  # verl's prompts are conversations: a completion is one assistant message, as in TRL
    return c if isinstance(c, str) else c[-1]["content"]


def correct(completions, solution, **kwargs):
    return [1.0 if str(s) in _text(c) else 0.0 for c, s in zip(completions, solution)]


def shorter(completions, **kwargs):
    return [-len(_text(c)) / 100 for c in completions]


def string_only(completions, **kwargs):
    return [float(isinstance(c, str)) for c in completions]


def not_applicable(completions, **kwargs):
    return [None for _ in completions]


def needs_ids(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):  # verl.trainer.ppo.reward._call_with_kwargs
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


def _verl_loads(reward_kwargs):
    spec = importlib.util.spec_from_file_location("custom_module", ADAPTER)  # verl's load_extern_object
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return partial(_call_with_kwargs, getattr(module, "compute_score"), reward_kwargs)


def test_compute_score_runs_trl_functions_as_verl_calls_it():
    fn = _verl_loads({"funcs": ["test_rewards_verl_adapter:correct", "test_rewards_verl_adapter:shorter",
                                "test_rewards_verl_adapter:not_applicable"],
                      "weights": [1.0, 0.5, 1.0], "answer_column": "solution"})
    score = fn(data_source="gsm8k", solution_str="The answer is 72.", ground_truth="72",
               extra_info={"split": "train", "index": 3})
    assert score["correct"] == 1.0 and score["shorter"] == pytest.approx(-0.17)
    assert math.isnan(score["not_applicable"])  # None: left out of the sum, as in TRL
    assert score["score"] == pytest.approx(1.0 - 0.5 * 0.17)
    wrong = fn(data_source="gsm8k", solution_str="no idea", ground_truth="72", extra_info={})
    assert wrong["correct"] == 0.0


def test_builtin_math_reads_the_ground_truth():
    fn = _verl_loads({"funcs": ["math"]})
    assert fn(data_source="x", solution_str="so \\boxed{\\frac{1}{2}}", ground_truth="0.5", extra_info=None)["score"] == 1.0


def test_what_verl_does_not_pass_fails_loudly():
    fn = _verl_loads({"funcs": ["test_rewards_verl_adapter:needs_ids"]})
    with pytest.raises(TypeError):  # completion_ids are None in verl: an error, never a wrong value
        fn(data_source="x", solution_str="abc", ground_truth="1", extra_info={})


def test_completions_are_messages_unless_asked_for_strings():
    msgs = _verl_loads({"funcs": ["test_rewards_verl_adapter:string_only"]})
    assert msgs(data_source="x", solution_str="abc", ground_truth="1", extra_info={})["score"] == 0.0
    plain = _verl_loads({"funcs": ["test_rewards_verl_adapter:string_only"], "conversational": False})
    assert plain(data_source="x", solution_str="abc", ground_truth="1", extra_info={})["score"] == 1.0
