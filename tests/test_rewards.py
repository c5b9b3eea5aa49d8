"""Reward functions with TRL's contract and the guarded calls that run them (tokencredit.data.rewards):
the arguments a function receives, weights and None, failures (counted, and the stop after
consecutive failing steps), a call that passes its budget is ended with its worker process, each
call works on its own copy of the rows, the worker is a daemon and leaves nothing behind.
Nothing here waits on a clock: a blocking reward blocks on an Event that is never set."""

from __future__ import annotations

import math
import os
import threading

import pytest

from tokencredit.data.datasource import Example
from tokencredit.data.rewards import (
    RewardFailure,
    RewardFnError,
    RewardRunner,
    completion_metrics,
    load_reward_funcs,
    per_sample_func,
    reward_metrics,
)

# -- reward functions, imported by name in the worker process ("test_rewards:NAME") --------------


def contract(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra, **kwargs):
    """1.0 per completion when every argument is what TRL passes, else an AssertionError."""
    n = len(completions)
    assert len(prompts) == len(completion_ids) == len(answer) == n, (len(prompts), len(completion_ids), len(answer), n)
    assert all(isinstance(c, str) for c in completions), completions
    assert all(isinstance(i, list) and all(isinstance(t, int) for t in i) for i in completion_ids), completion_ids
    assert kwargs["level"] == ["easy", "easy", "hard"], kwargs
    assert "prompt" not in kwargs and "question" not in kwargs, sorted(kwargs)  # the prompt column is `prompts`
    assert prompts == ["Q1", "Q1", "Q2"], prompts
    assert trainer_state.global_step == 7, trainer_state
    log_metric("seen", n)
    return [1.0] * n


def length_plus_answer(completions, completion_ids, answer, **kwargs):
    return [len(ids) + float(a) for ids, a in zip(completion_ids, answer)]


def half_none(completions, **kwargs):
    return [None if i % 2 else -2.5 for i in range(len(completions))]


def raises(completions, **kwargs):
    raise RuntimeError("grader down")


def wrong_length(completions, **kwargs):
    return [1.0]


def bad_values(completions, **kwargs):
    return ["1.0", float("nan")] + [0.5] * (len(completions) - 2)


def exits(completions, **kwargs):
    os._exit(3)


_NEVER = threading.Event()


def blocks_forever(completions, **kwargs):
    _NEVER.wait()  # never set: only the worker's end stops this call
    return [1.0] * len(completions)


def spins_forever(completions, **kwargs):
    while True:  # burns CPU until the process is killed
        pass


def mutates(prompts, completions, answer, **kwargs):
    prompts[0] = "CHANGED"
    answer[0] = "999"
    kwargs["level"].clear()
    return [0.0] * len(completions)


def sees_original(prompts, completions, answer, level, **kwargs):
    return [1.0 if (prompts[0], answer[0], len(level)) == ("Q1", "3", 3) else 0.0] * len(completions)


def flaky_by_step(completions, trainer_state, **kwargs):
    if trainer_state.global_step % 2:
        raise ValueError("odd step")
    return [1.0] * len(completions)


def per_sample_grader(completion, example):
    return 1.0 if completion.endswith(example.answer) else 0.0


# -- helpers ----------------------------------------------------------------------------------


def _examples():
    a = Example(id="r1", question="Q1", answer="3", messages=({"role": "user", "content": "Q1"},), prompt="Q1",
                row={"answer": "3", "level": "easy"})
    b = Example(id="r2", question="Q2", answer="4", messages=({"role": "user", "content": "Q2"},), prompt="Q2",
                row={"answer": "4", "level": "hard"})
    return [a, a, b]


def _score(runner, completions=("x 3", "y", "z 4"), ids=((5, 6), (7,), (8, 9, 10)), step=7):
    exs = _examples()
    return runner.score(list(completions), [list(i) for i in ids], exs, [e.prompt for e in exs],
                        state={"global_step": step, "max_steps": 10})


@pytest.fixture
def runner_of():
    made = []

    def make(*specs, weights=(), timeout_s=5.0, max_failing_steps=2):
        r = RewardRunner(load_reward_funcs(list(specs), list(weights)), timeout_s=timeout_s, max_failing_steps=max_failing_steps)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# -- the contract -----------------------------------------------------------------------------


def test_a_function_receives_trls_arguments(runner_of):
    r = runner_of("test_rewards:contract")
    s = _score(r)
    assert s.failed == {"error": 0, "timeout": 0}, s.first_failure
    assert s.values == [[1.0, 1.0, 1.0]]
    assert s.extra == {"rewards/extra/seen": 3.0}  # log_metric reaches the run's metrics


def test_weights_none_and_the_weighted_sum(runner_of):
    r = runner_of("test_rewards:length_plus_answer", "test_rewards:half_none", weights=(1.0, 0.1))
    s = _score(r)
    assert s.names == ["length_plus_answer", "half_none"]
    assert s.values[0] == [5.0, 4.0, 7.0]
    assert s.values[1][0] == -2.5 and math.isnan(s.values[1][1]) and s.values[1][2] == -2.5  # None: not scored
    assert s.total == pytest.approx([5.0 - 0.25, 4.0, 7.0 - 0.25])  # any range; None left out of the sum
    m = reward_metrics([s], [[0, 0, 1]])
    assert m["rewards/length_plus_answer/mean"] == pytest.approx(16 / 3)
    assert m["rewards/half_none/mean"] == -2.5 and m["rewards/half_none/std"] == 0.0
    assert m["reward"] == pytest.approx(sum(s.total) / 3)
    assert m["frac_reward_zero_std"] == 0.5  # group 1 has one completion: zero std; group 0 differs


def test_builtin_graders_read_the_answer_column():
    funcs = load_reward_funcs(["math", "numeric"], answer_column="answer")
    r = RewardRunner(funcs, timeout_s=30.0)
    try:
        s = _score(r, completions=("so \\boxed{3}", "The answer is 5.", "4"))
    finally:
        r.close()
    assert s.values == [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]


def test_completion_metrics_use_trls_names():
    m = completion_metrics([4, 2, 4, 1], [True, False, True, False])
    assert m["completions/clipped_ratio"] == 0.5
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (2.75, 1.0, 4.0)
    assert m["completions/mean_terminated_length"] == 1.5


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, kind, message",
    [
        ("test_rewards:raises", "error", "RuntimeError: grader down"),
        ("test_rewards:wrong_length", "error", "returned 1 values for 3 completions"),
        ("test_rewards:exits", "error", "the reward worker process ended (exit code 3)"),
    ],
)
def test_a_failing_call_fails_every_completion_and_names_the_cause(runner_of, spec, kind, message):
    r = runner_of(spec)
    s = _score(r)
    assert s.failed[kind] == 3 and s.all_failed == [True] and s.total == [0.0, 0.0, 0.0]
    assert s.first_failure[0].startswith("row r1: ") and message in s.first_failure[0]
    assert all(math.isnan(v) for v in s.values[0])
    # the runner goes on: the next call works (a fresh worker where the old one died)
    r.funcs[0] = load_reward_funcs(["test_rewards:length_plus_answer"])[0]
    r._worker.loaded.discard(0)
    assert _score(r).values == [[5.0, 4.0, 7.0]]


def test_bad_values_fail_their_completion_only(runner_of):
    s = _score(runner_of("test_rewards:bad_values"))
    assert s.failed["error"] == 2 and s.all_failed == [False]
    assert "expected a real number, got str" in s.first_failure[0]
    assert s.values[0][2] == 0.5


def test_every_completion_failing_for_n_steps_stops_the_run_with_one_line(runner_of):
    r = runner_of("test_rewards:raises", "test_rewards:length_plus_answer", max_failing_steps=2)
    r.end_step(1, [_score(r)])  # the first failing step: counted, the run goes on
    with pytest.raises(RewardFailure) as e:
        r.end_step(2, [_score(r)])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("reward test_rewards:raises: failed on every completion of 2 consecutive steps")
    assert "row r1: RuntimeError: grader down" in msg


def test_sporadic_failures_are_counted_not_fatal(runner_of):
    r = runner_of("test_rewards:flaky_by_step", max_failing_steps=2)
    failed = 0
    for step in range(1, 7):
        s = _score(r, step=step)
        failed += s.failed["error"]
        r.end_step(step, [s])  # fails on odd steps only: never two in a row
    assert failed == 9


def test_per_sample_graders_fail_per_completion():
    r = RewardRunner([per_sample_func(per_sample_grader, (0.0, 1.0))], timeout_s=5.0)
    try:
        s = _score(r, completions=("x 3", "y", "z 4"))
    finally:
        r.close()
    assert s.values == [[1.0, 0.0, 1.0]] and s.failed["error"] == 0


# -- the budget: a call is ended with its worker -------------------------------------------------


@pytest.mark.parametrize("spec", ["test_rewards:blocks_forever", "test_rewards:spins_forever"])
def test_a_call_past_its_budget_is_ended_and_its_worker_killed(runner_of, spec):
    import multiprocessing

    r = runner_of(spec, timeout_s=0.05)
    s = _score(r)
    assert s.failed["timeout"] == 3 and s.all_failed == [True]
    assert "passed its 0.15 s budget and was ended" in s.first_failure[0]
    # the timed-out worker is gone (killed and reaped, not abandoned): nothing keeps running its call
    assert r._worker.proc is None
    assert not [p for p in multiprocessing.active_children() if p.name == "tokencredit-reward"]
    # the next call runs in a fresh worker (a generous budget: only the outcome is asserted)
    r.funcs[0] = load_reward_funcs(["test_rewards:length_plus_answer"])[0]
    r.timeout_s = 60.0
    assert _score(r).values == [[5.0, 4.0, 7.0]]
    (alive,) = [p for p in multiprocessing.active_children() if p.name == "tokencredit-reward"]
    assert alive is r._worker.proc and alive.daemon


def test_close_leaves_no_worker_behind(runner_of):
    import multiprocessing

    r = runner_of("test_rewards:length_plus_answer")
    _score(r)
    proc = r._worker.proc
    assert proc.is_alive() and proc.daemon  # a daemon: it cannot keep a finished process alive
    r.close()
    assert not proc.is_alive()
    assert not [p for p in multiprocessing.active_children() if p.name == "tokencredit-reward"]


def test_each_call_gets_its_own_copy_of_the_rows(runner_of):
    r = runner_of("test_rewards:mutates", "test_rewards:sees_original")
    exs = _examples()
    s = r.score(["a", "b", "c"], [[1], [2], [3]], exs, [e.prompt for e in exs])
    assert s.values[1] == [1.0, 1.0, 1.0]  # the second function saw the rows as they were
    assert exs[0].prompt == "Q1" and exs[0].row == {"answer": "3", "level": "easy"}  # the trainer's rows too


# -- loading: one line before any model loads ----------------------------------------------------


@pytest.mark.parametrize(
    "specs, match",
    [
        (["surely_missing_pkg_42:fn"], "reward.funcs 'surely_missing_pkg_42:fn': cannot import module"),
        (["test_rewards:nope"], "has no attribute 'nope'"),
        (["test_rewards:per_sample_grader"], "expected a function of TRL's keyword arguments"),
        (["mathh"], "expected a built-in name \\(math, numeric\\) or 'module:function', got 'mathh'"),
    ],
)
def test_unusable_functions_are_one_line(specs, match):
    with pytest.raises(RewardFnError, match=match) as e:
        load_reward_funcs(specs)
    assert "\n" not in str(e.value)


def test_a_trl_function_given_as_task_reward_fn_is_pointed_to_reward_funcs():
    from tokencredit.data.rewards import load_reward_fn

    with pytest.raises(RewardFnError, match="give it as --reward.funcs test_rewards:length_plus_answer"):
        load_reward_fn("test_rewards:length_plus_answer")


def test_a_module_next_to_the_data_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_local_rewards.py").write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    r = RewardRunner(load_reward_funcs(["my_local_rewards:one"]))
    try:
        assert _score(r).values == [[1.0, 1.0, 1.0]]
    finally:
        r.close()


# -- budget sanity ------------------------------------------------------------------------------


def crc_completion(completions, **kwargs):
    import zlib

    return [float(zlib.crc32(c.encode()) % 2) for c in completions]


@pytest.mark.parametrize("threshold, warned", [(0.5, True), (1.0, False)])
def test_a_budget_that_clips_most_completions_is_warned_about(tmp_path, caplog, threshold, warned):
    """A random tiny model never ends a completion (EOS is 1 token in 99): every completion hits
    max_new_tokens, completions/clipped_ratio is 1.0, and above reward.clipped_warn_ratio the log
    says so, naming the budget."""
    import logging

    from tokencredit.train.config import (
        LogConfig,
        ModelConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(
        steps=1, output_dir=str(tmp_path / "run"), model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=8, n_eval=1),
        reward=RewardConfig(funcs=("test_rewards:crc_completion",), clipped_warn_ratio=threshold),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=3, temperature=1.0),
        optim=OptimConfig(micro_batch_size=4),
        log=LogConfig(eval_every=100, eval_samples=0, progress=False, eval_at_start=False, save_rollouts=False),
    )
    model, tok = tiny_model_and_tokenizer(seed=0)
    tr = Trainer(cfg, model=model, tokenizer=tok)
    with caplog.at_level(logging.WARNING, logger="tokencredit.train.trainer"):
        last = tr.train()
    assert last["completions/clipped_ratio"] == 1.0
    lines = [r.getMessage() for r in caplog.records if "hit rollout.max_new_tokens" in r.getMessage()]
    assert bool(lines) is warned
    if warned:
        assert lines[0].startswith("step 1: 100% of the completions hit rollout.max_new_tokens (3) without ending")
