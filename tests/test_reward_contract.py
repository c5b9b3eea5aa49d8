"""User reward code and what a run makes of it (issue 29, findings 6, 7, 8, 10, 12).

* 6: the processes a reward function starts (a plain ``fork()``, a subprocess it waits on) end
  with its worker: after the run, after a timeout kill, after a run that exits 2.
* 7: a reward module is imported in the worker process, never in the trainer's; ``eval --run`` on
  a folder whose config names reward code says which code it would run and refuses without
  ``--trust-remote-code``.
* 8: one reward contract on a verl-layout parquet for ``train``, the TRL subclass and the verl
  adapter: the same keyword arguments for the same rows.
* 10: a reward that fails every call of a run shorter than ``reward.max_failing_steps`` stops it
  (exit 2); all-None is warned about, a dict is refused, ``eval/greedy_acc`` is an accuracy, the
  ``numeric`` reward reads fractions.
* 12: TRL's metric names, each metric once.
"""

from __future__ import annotations

import contextlib
import json
import math
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokencredit.data.datasource import Example
from tokencredit.data.grading import answers_match, extract_final_answer, numeric_accuracy
from tokencredit.data.rewards import RewardFailure, RewardRunner, load_reward_funcs

from test_reliability import _cli, tiny_cli  # noqa: F401 (the command line in-process, the tiny model as any named one)



# -- reward functions, imported by name in the worker process ("test_reward_contract:NAME") -----


def returns_dict(completions, **kwargs):
    return {"score": 1.0, "acc": 0.0, "extra": 2.0}


def all_none(completions, **kwargs):
    return [None] * len(completions)


def always_raises(completions, **kwargs):
    raise RuntimeError("grader down")


def huge(completions, **kwargs):
    return [1e308 if i % 2 else 1.0 for i in range(len(completions))]


def _examples(extra=None):
    rows = [{"answer": "3", **(extra or {})}, {"answer": "4", **(extra or {})}]
    exs = [Example(id=f"r{i}", question=f"Q{i}", answer=r["answer"], messages=({"role": "user", "content": f"Q{i}"},),
                   prompt=f"Q{i}", row=r) for i, r in enumerate(rows)]
    return [exs[0], exs[0], exs[1]]


def _score(runner, completions=("x 3", "y", "z 4"), extra=None, step=1):
    exs = _examples(extra)
    return runner.score(list(completions), [[1], [2], [3]], exs, [e.prompt for e in exs],
                        state={"global_step": step, "max_steps": 10})


def _data_file(tmp_path, **extra):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), **extra} for a in range(3) for b in range(3)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tiny_flags(tmp_path, data):
    return ["--model.name", "tiny", "--data.path", str(data), "--data.eval-fraction", "0.2", "--output-dir",
            str(tmp_path / "run"), "--rollout.prompts-per-step", "2", "--rollout.samples-per-prompt", "2",
            "--rollout.max-new-tokens", "4", "--optim.micro-batch-size", "4", "--log.eval-samples", "0",
            "--log.no-progress", "--log.no-eval-at-start", "--save-every", "1"]


@pytest.fixture
def runner_of():
    made = []

    def make(*specs, timeout_s=5.0, max_failing_steps=2):
        r = RewardRunner(load_reward_funcs(list(specs)), timeout_s=timeout_s, max_failing_steps=max_failing_steps)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# -- 10. values a run must not misread ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, gold, match",
    [
        ("The answer is 3/4.", "0.75", True),
        ("The answer is 3/4.", "3", False),  # was read as 3
        ("The answer is 3 / 4.", "3", False),
        ("So \\boxed{3/4}", "3/4", True),
        ("So \\boxed{\\frac{3}{4}}", "0.75", True),
        ("6/8", "3/4", True),
        ("What is 6/3? 6/3 = 2", "2", True),  # a restated fraction is an operand, as 6 / 3 was
        ("on 1/2/2020", "1", False),  # a date is no number
        ("The answer is 5/0.", "5", False),
    ],
)
def test_numeric_reads_fractions_or_refuses_them(text, gold, match):
    assert answers_match(extract_final_answer(text), gold) is match
    assert numeric_accuracy([text], answer=[gold]) == [1.0 if match else 0.0]


def test_a_reward_returning_a_dict_is_refused_not_read_by_its_keys(runner_of):
    s = _score(runner_of("test_reward_contract:returns_dict"))
    assert s.all_failed == [True] and s.failed["error"] == 3
    assert "expected a list of 3 floats (or None), one per completion, got dict" in s.first_failure[0]
    assert "\n" not in s.first_failure[0]


def test_a_reward_returning_none_for_every_completion_is_warned_once(runner_of, caplog):
    r = runner_of("test_reward_contract:all_none")
    with caplog.at_level(logging.WARNING, logger="tokencredit.data.rewards"):
        for step in (1, 2):
            r.end_step(step, [_score(r, step=step)])
    lines = [m for m in caplog.messages if "all_none" in m]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "returned None for every completion of step 1" in lines[0]


def test_every_call_failing_in_a_run_shorter_than_max_failing_steps_is_an_error(runner_of):
    r = runner_of("test_reward_contract:always_raises", max_failing_steps=5)
    with pytest.raises(RewardFailure, match="failed on every completion of every step of the run") as e:
        r.end_step(1, [_score(r)], last=True)
    assert "\n" not in str(e.value) and "grader down" in str(e.value)
    # a function that scored once in the run is no error at its end
    r2 = runner_of("test_reward_contract:all_none", max_failing_steps=5)
    r2.end_step(1, [_score(r2)], last=True)


def test_a_run_shorter_than_max_failing_steps_whose_reward_always_fails_exits_2(tmp_path, tiny_cli):
    data = _data_file(tmp_path)
    code, err = _cli(["train", *_tiny_flags(tmp_path, data), "--reward.funcs", "test_reward_contract:always_raises",
                      "--steps", "1", "--reward.max-failing-steps", "2"])
    assert code == 2, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("tokencredit train:")]
    assert "always_raises: failed on every completion of every step of the run (1 step(s)" in line
    assert not (tmp_path / "run" / "final").exists()


def test_a_reward_too_large_for_float32_statistics_is_a_failed_call(runner_of):
    """1e308 is finite as a Python float, but inf in the float32 rewards tensor, and its square
    overflows a group's std long before: the call fails in one line naming the bound."""
    s = _score(runner_of("test_reward_contract:huge"))
    assert s.failed["error"] == 1 and s.all_failed == [False]
    assert "reward: expected a number of magnitude at most 1e+15" in s.first_failure[0]
    assert "got 1e+308" in s.first_failure[0] and "\n" not in s.first_failure[0]
    assert all(math.isfinite(t) for t in s.total)


def test_a_run_whose_rewards_are_1e308_trains_on_the_finite_ones(tmp_path, tiny_cli):
    data = _data_file(tmp_path)
    code, err = _cli(["train", *_tiny_flags(tmp_path, data), "--reward.funcs", "test_reward_contract:huge", "--steps", "1"])
    assert code == 0, err
    assert "Traceback" not in err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward" in r]
    assert train and all(math.isfinite(r["reward"]) for r in train)


# -- 6. the processes a reward starts end with its worker -----------------------------------------


def _sleep_forever_in_child() -> int:
    pid = os.fork()
    if pid == 0:  # the child: sleeps until killed, never returns into the worker's loop
        try:
            while True:
                time.sleep(0.05)
        finally:
            os._exit(0)
    return pid


def forks_a_sleeper(completions, pidfile, **kwargs):
    with open(pidfile[0], "a") as f:
        f.write(f"{_sleep_forever_in_child()}\n")
    return [1.0] * len(completions)


def forks_then_raises(completions, pidfile, **kwargs):
    forks_a_sleeper(completions, pidfile)
    raise RuntimeError("grader down")


def waits_on_a_subprocess(completions, pidfile, **kwargs):
    p = subprocess.Popen(["sleep", "1000"])
    with open(pidfile[0], "a") as f:
        f.write(f"{p.pid}\n")
    p.wait()  # passes the call's budget: the call is ended
    return [1.0] * len(completions)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended (its parent, gone too, no longer reaps it)


def _pids(pidfile: Path):
    return [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []


def _all_end(pids, within_s=10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_running(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def pidfile(tmp_path):
    path = tmp_path / "pids.txt"
    yield path
    for pid in _pids(path):  # never leave a process behind, whatever the test found
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)


def test_a_process_forked_by_a_reward_ends_with_the_run(runner_of, pidfile):
    r = runner_of("test_reward_contract:forks_a_sleeper")
    s = _score(r, extra={"pidfile": str(pidfile)})
    assert s.values == [[1.0, 1.0, 1.0]]
    (pid,) = _pids(pidfile)
    assert _running(pid)  # alive while the run goes on (the worker is reused)
    r.close()
    assert _all_end([pid])


def test_a_subprocess_of_a_call_past_its_budget_ends_with_it(runner_of, pidfile):
    r = runner_of("test_reward_contract:waits_on_a_subprocess", timeout_s=0.3)
    s = _score(r, extra={"pidfile": str(pidfile)})
    assert s.failed["timeout"] == 3
    (pid,) = _pids(pidfile)
    assert _all_end([pid])  # the worker's process group was killed with it


def test_a_process_forked_by_a_reward_ends_when_the_run_exits_2(tmp_path, tiny_cli, pidfile):
    data = _data_file(tmp_path, pidfile=str(pidfile))
    code, err = _cli(["train", *_tiny_flags(tmp_path, data), "--reward.funcs", "test_reward_contract:forks_then_raises",
                      "--steps", "3", "--reward.max-failing-steps", "1"])
    assert code == 2 and "grader down" in err, err
    pids = _pids(pidfile)
    assert pids and _all_end(pids)


def test_greedy_acc_is_an_accuracy_and_the_weighted_reward_is_eval_reward():
    """Two functions (a 0/1 accuracy first, a length penalty weighted in): greedy_acc is the share
    of rows the first function calls correct (reward >= 1), not the weighted sum's mean."""
    import torch

    from tokencredit.train.evaluation import evaluate_split
    from tokencredit.data.rewards import RewardScores

    exs = _examples()[1:]  # two rows
    acc, pen = [1.0, 0.0], [-0.25, -0.75]

    def generate(part, num_samples, temperature, seed=None):
        n = len(part) * num_samples
        return type("RB", (), {"texts": ["t"] * n, "prompt_index": torch.arange(len(part)).repeat_interleave(num_samples)})()

    def reward_scores(rb, part):
        n = len(rb.texts)
        a, p = (acc * n)[:n], (pen * n)[:n]
        return RewardScores(["acc", "pen"], [a, p], [x + 0.5 * y for x, y in zip(a, p)], {"error": 0, "timeout": 0},
                            [0, 0], [False, False], [None, None])

    m, samples = evaluate_split(exs, generate=generate, reward_scores=reward_scores, k=2, temperature=1.0,
                                seed=lambda s: s, chunk=16, n_funcs=2)
    assert m["eval/greedy_acc"] == 0.5  # one of two rows correct
    assert m["eval/reward"] == pytest.approx(((1.0 - 0.125) + (0.0 - 0.375)) / 2)  # the weighted sum, as it was
    assert m["eval/mean@2"] == 0.5
    assert [s["reward"] for s in samples] == [pytest.approx(0.875), pytest.approx(-0.375)]


# -- 7. user code is imported in the worker, and eval --run asks before running it ----------------

_MARKS_IMPORT = (
    "import os\n"
    "with open({mark!r}, 'a') as f:\n"
    "    f.write(str(os.getpid()) + '\\n')\n"
    "def fn(completions, **kwargs):\n"
    "    return [1.0] * len(completions)\n"
    "def per_completion(completion, example):\n"
    "    return 1.0\n"
)


def _marking_module(tmp_path, name="marks_import"):
    mark = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(_MARKS_IMPORT.format(mark=str(mark)))
    return tmp_path / f"{name}.py", mark


def test_a_reward_module_is_imported_in_the_worker_never_in_the_trainer(tmp_path, runner_of):
    from tokencredit.data.rewards import load_reward_fn

    path, mark = _marking_module(tmp_path)
    funcs = load_reward_funcs([f"{path}:fn"])
    assert funcs[0].name == "fn"
    fn = load_reward_fn(f"{path}:per_completion")
    assert fn.__name__ == "per_completion"
    pids = [int(x) for x in mark.read_text().split()]
    assert len(pids) == 2 and os.getpid() not in pids  # imported twice, each time in a worker
    assert not [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(path)]
    r = runner_of(f"{path}:fn")
    assert _score(r).values == [[1.0, 1.0, 1.0]]
    assert os.getpid() not in [int(x) for x in mark.read_text().split()]


def test_a_module_that_hangs_at_import_is_ended_in_one_line(tmp_path, monkeypatch):
    import tokencredit.data.rewards as rewards

    import multiprocessing

    def workers():  # this process's reward workers (an earlier test's may await collection)
        return {p.pid for p in multiprocessing.active_children() if p.name == "tokencredit-reward"}

    (tmp_path / "hangs_at_import.py").write_text("import time\ntime.sleep(1000)\ndef fn(completions, **kw):\n    return []\n")
    monkeypatch.setattr(rewards, "LOAD_TIMEOUT_S", 1.0)
    before = workers()
    with pytest.raises(rewards.RewardFnError) as e:
        load_reward_funcs([f"{tmp_path / 'hangs_at_import.py'}:fn"])
    assert "importing it in the reward worker took more than 1 s and was ended" in str(e.value)
    assert "\n" not in str(e.value)
    assert not workers() - before  # the worker that hung is gone


def test_eval_run_names_the_reward_code_and_runs_it_only_when_trusted(tmp_path, tiny_cli):
    path, mark = _marking_module(tmp_path)
    data = _data_file(tmp_path)
    code, err = _cli(["train", *_tiny_flags(tmp_path, data), "--reward.funcs", f"{path}:fn", "--steps", "1"])
    assert code == 0, err
    mark.unlink()  # the run imported it (in its worker); a folder someone sent would come without the file
    out = tmp_path / "ev"
    code, err = _cli(["eval", "--run", str(tmp_path / "run"), "--output-dir", str(out)])
    assert code == 2
    (line,) = err.strip().splitlines()
    assert f"reward.funcs {path}:fn" in line and "--trust-remote-code" in line
    assert not mark.exists() and not out.exists()  # nothing imported, nothing written
    code, err = _cli(["eval", "--run", str(tmp_path / "run"), "--output-dir", str(out), "--trust-remote-code"])
    assert code == 0, err
    assert f"reward.funcs {path}:fn" in err and mark.exists()


# -- 8. one reward contract for every trainer on a verl-layout parquet ----------------------------

_CONTRACT_EXTRA = ("prompts", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments")


def verl_style(completions, ground_truth, data_source, extra_info, **kwargs):
    """A verl-style function in TRL's form: records what it was given (one JSON line per
    completion, in the file its rows name) and scores 1.0 when the completion holds the truth."""
    rows = {k: v for k, v in kwargs.items() if k not in _CONTRACT_EXTRA}
    with open(extra_info[0]["record"], "a") as f:
        for i, c in enumerate(completions):
            seen = {"ground_truth": ground_truth[i], "data_source": data_source[i], "extra_info": extra_info[i],
                    **{k: v[i] for k, v in rows.items()}}
            f.write(json.dumps({"row": seen, "completion": [sorted(m) for m in c] if isinstance(c, list) else type(c).__name__},
                               sort_keys=True) + "\n")
    return [1.0 if str(g) in c[-1]["content"] else 0.0 for c, g in zip(completions, ground_truth)]


def _verl_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    record = str(tmp_path / "seen.jsonl")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "data_source": f"toy{i % 2}",
             "reward_model": {"ground_truth": str(i + 1), "style": "rule"},
             "extra_info": {"index": i, "split": "train", "record": record}} for i in range(6)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path, Path(record), rows


def _seen(record: Path):
    out = {}
    for line in record.read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["row"]["extra_info"]["index"], set()).add(json.dumps(r, sort_keys=True))
    record.unlink()
    return out


def test_one_verl_style_function_gets_the_same_arguments_in_train_trl_and_verl(tmp_path):
    """The verl adapter's reading of the verl layout is the reference (ground_truth from
    reward_model, data_source, extra_info and its keys as columns, conversational completions):
    `train` and TokenCreditGRPOTrainer give the same function the same keyword arguments."""
    import importlib.util
    from functools import partial

    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from trl import GRPOConfig

    import tokencredit
    from tokencredit.train.config import (
        DataConfig,
        LogConfig,
        ModelConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        TrainConfig,
    )
    from tokencredit.integrations.trl import TokenCreditGRPOTrainer, checkpointing_args
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    path, record, rows = _verl_parquet(tmp_path)

    # verl: its reward manager calls the adapter once per response (naive.py's arguments and additions)
    spec = importlib.util.spec_from_file_location("custom_module", Path(tokencredit.__file__).parent / "integrations" / "verl" / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compute_score = partial(module.compute_score, funcs=["test_reward_contract:verl_style"])
    for row in datasets.Dataset.from_parquet(str(path)):
        extra_info = dict(row["extra_info"], num_turns=None, rollout_reward_scores={})
        out = compute_score(data_source=row["data_source"], solution_str=f"so {row['reward_model']['ground_truth']}",
                            ground_truth=row["reward_model"]["ground_truth"], extra_info=extra_info)
        assert out["score"] == 1.0
    verl = _seen(record)
    assert sorted(verl) == list(range(6))

    # the own trainer
    cfg = TrainConfig(
        steps=1, output_dir=str(tmp_path / "run"), model=ModelConfig(name="tiny"),
        data=DataConfig(path=str(path), eval_fraction=0.2), reward=RewardConfig(funcs=("test_reward_contract:verl_style",)),
        rollout=RolloutConfig(prompts_per_step=3, samples_per_prompt=2, max_new_tokens=3, temperature=1.0),
        optim=OptimConfig(micro_batch_size=6),
        log=LogConfig(eval_every=100, eval_samples=0, progress=False, eval_at_start=False, save_rollouts=False),
    )
    model, tok = tiny_model_and_tokenizer(seed=0)
    Trainer(cfg, model=model, tokenizer=tok).train()
    own = _seen(record)

    # the TRL subclass
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=3, report_to="none", save_strategy="no", disable_tqdm=True,
                      seed=0, **checkpointing_args(False))
    TokenCreditGRPOTrainer(model=model, reward_funcs=verl_style, args=args, processing_class=tok,
                           train_dataset=datasets.Dataset.from_parquet(str(path))).train()
    trl = _seen(record)

    for name, got in (("train", own), ("TokenCreditGRPOTrainer", trl)):
        assert got, name
        for index, seen in got.items():
            assert seen == verl[index], (name, index, seen, verl[index])
    (first,) = verl[0]
    assert json.loads(first)["row"] == {"ground_truth": "1", "data_source": "toy0", "index": 0, "split": "train",
                                        "record": str(record), "extra_info": {"index": 0, "split": "train", "record": str(record)}}
    assert json.loads(first)["completion"] == [["content", "role"]]  # one assistant message


# -- 12. TRL's metric names, each metric once; the small things a user sees every run -------------

#: TRL's GRPOTrainer names (trl/trainer/grpo_trainer.py, transformers' Trainer for loss and
#: learning_rate) of the metrics the own trainer has too
TRL_NAMES = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "learning_rate", "loss",
             "step_time", "num_tokens", "completions/mean_length", "completions/clipped_ratio", "reward", "reward_std",
             "frac_reward_zero_std", "kl", "grad_norm")
#: the names they replace (never logged: a metric is logged once)
OLD_NAMES = ("entropy/mean", "loss/ppo/clip_frac_low", "loss/ppo/clip_frac_high", "loss/ppo/clip_frac", "lr", "loss/policy",
             "time/step_s", "reward/mean", "response/len_mean", "response/truncated_frac", "loss/kl")


def test_the_own_trainer_logs_trls_metric_names_once(tmp_path, caplog):
    from tokencredit.train.config import (
        LogConfig,
        LossConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )
    from tokencredit.train.runfolder import read_metrics
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(
        steps=2, output_dir=str(tmp_path / "run"), model=ModelConfig(name="tiny"), task=TaskConfig(name="add1", n_train=8, n_eval=2),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=3, temperature=1.0),
        optim=OptimConfig(micro_batch_size=4), loss=LossConfig(kl_coef=0.1),
        log=LogConfig(eval_every=1, eval_samples=0, progress=False, eval_at_start=False, save_rollouts=False),
    )
    model, tok = tiny_model_and_tokenizer(seed=0)
    with caplog.at_level(logging.WARNING):
        Trainer(cfg, model=model, tokenizer=tok).train()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for row in rows:
        assert [k for k in TRL_NAMES if k not in row] == [], sorted(row)
        assert [k for k in OLD_NAMES if k in row] == []
    # num_tokens: the prompt and completion tokens trained on so far (TRL's num_input_tokens_seen)
    assert 0 < rows[0]["num_tokens"] < rows[1]["num_tokens"]
    assert not [m for m in caplog.messages if "deprecated" in m.lower()]


class _Bar:
    def __init__(self):
        self.postfix = None

    def update(self, n):
        pass

    def set_postfix(self, **kw):
        self.postfix = kw


def test_the_progress_bar_shows_the_last_eval_accuracy_between_evals():
    from tokencredit.train.trainer import _show_progress

    bar = _Bar()
    _show_progress(bar, {"reward": 0.5, "entropy": 1.0}, 0.5)
    assert "acc" not in bar.postfix  # no eval yet: nothing, never "nan"
    _show_progress(bar, {"reward": 0.5, "entropy": 1.0, "eval/greedy_acc": 0.75}, 0.5)
    assert bar.postfix["acc"] == "0.75" and bar.postfix["reward"] == "0.50" and bar.postfix["entropy"] == "1.000"
    _show_progress(bar, {"reward": 0.25, "entropy": 1.0}, 0.5)
    assert bar.postfix["acc"] == "0.75"  # the last eval's, until the next one


def test_eval_samples_carry_the_answer_of_a_ground_truth_column(tmp_path, tiny_cli):
    rows = [{"prompt": f"What is {i} + 1?", "ground_truth": str(i + 1)} for i in range(10)]
    data = tmp_path / "gt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = _cli(["train", *_tiny_flags(tmp_path, data), "--reward.funcs", "numeric", "--steps", "1"])
    assert code == 0, err
    samples = [json.loads(x) for x in (tmp_path / "run" / "eval" / "samples_step_00000001.jsonl").read_text().splitlines()]
    assert samples and [s["answer"] for s in samples] == [str(int(s["question"].split()[2]) + 1) for s in samples]


def test_the_saved_trl_batch_is_labelled_with_the_step_that_trained_on_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from tokencredit.analysis.inspector import load_rollouts
    from tokencredit.integrations.trl import TokenCreditGRPOTrainer, checkpointing_args
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}+1="}]} for i in range(4)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=3, report_to="none", save_strategy="steps", save_steps=2,
                      disable_tqdm=True, seed=0, **checkpointing_args(False))
    TokenCreditGRPOTrainer(model=model, reward_funcs=all_none_then_len, args=args, processing_class=tok, train_dataset=ds).train()
    saved = load_rollouts(tmp_path / "out")  # eval/rollouts_step_00000002.pt: the batch of step 2
    assert saved["step"] == 2


def all_none_then_len(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 2) for c in completions]


def test_the_help_gives_each_section_its_own_description(capsys):
    from tokencredit.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    # --overwrite's help once (its own), not again as the model and task sections' descriptions
    assert out.count("start again in an output_dir") == 1


class _NewCacheName(__import__("torch").nn.Module):
    """A model as transformers >= 5.2x has it: the KV cache is ``cache`` (``past_key_values`` a
    deprecated alias): a call or an output read by the old name fails here."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0,
                output_hidden_states=False):
        from types import SimpleNamespace

        o = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                       use_cache=use_cache, logits_to_keep=logits_to_keep, output_hidden_states=output_hidden_states)
        return SimpleNamespace(logits=o.logits, hidden_states=o.hidden_states, cache=o.past_key_values)


def test_forward_passes_use_the_cache_name_the_model_has():
    import torch

    from tokencredit.engine.forward import cache_name, checkpointing_on, forward_response
    from tokencredit.testing import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(seed=0)
    assert cache_name(model) == "past_key_values" or cache_name(model) == "cache"
    new = _NewCacheName(model)
    assert cache_name(new) == "cache" and checkpointing_on(model) is False
    ids = torch.tensor([[3, 4, 5, 6, 7], [3, 4, 5, 8, 9]])  # one prompt (3 tokens) shared by two rows
    att = torch.ones_like(ids)
    _, shared = forward_response(new, ids, att, 3)
    _, plain = forward_response(model, ids, att, 3, share_prompts=False)
    assert torch.allclose(shared, plain, atol=1e-5)


def test_metrics_of_runs_written_before_trls_names_are_read_by_the_new_names(tmp_path):
    from tokencredit.analysis.compare import read_metrics

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1.0, "reward/mean": 0.5, "entropy/mean": 1.5, "time/step_s": 2.0}) + "\n")
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row == {"step": 1.0, "reward": 0.5, "entropy": 1.5, "step_time": 2.0}
