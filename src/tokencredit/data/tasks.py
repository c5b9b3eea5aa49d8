"""Tasks: prompts plus a reward function.

A :class:`Task` holds ``train`` and ``eval`` lists of :class:`Example` and a ``reward(completion,
example) -> float`` in [0, 1]. ``make_task(name, ...)`` builds one:

    add1, add2, mul1   procedural arithmetic (1-digit addition, 2-digit addition, 1-digit
                       multiplication), enumerated from the whole question space
    word               1-2 step word problems from templates (apples, coins, birds, ...)
    mix                equal shares of add1, add2, mul1 and word
    keytok, carry,     controlled tasks of ``tokencredit bench`` (:mod:`tokencredit.data.controlled`):
    fork               responses of a fixed length over two or three letters, a response space
                       whose continuations can be enumerated (exact true credit)
    gsm8k, math        datasets (a local json/jsonl/csv/parquet file or folder, or a hub id, read
                       through ``datasets``: :mod:`tokencredit.data.datasource`), graded by math-verify

``make_data_task(data_config, ...)`` builds the task of own data (``--data.path``, see
:mod:`tokencredit.data.datasource`). Graders live in :mod:`tokencredit.data.grading`, reward functions and
the guarded calls that run them in :mod:`tokencredit.data.rewards`.

Splits. The eval split depends only on the task and ``n_eval`` (drawn with the fixed
``EVAL_SEED``), so runs with different seeds are compared on the same questions; the train split
is drawn with ``seed`` from the rest of the space, so no question is in both. Small spaces
(add1: 100 questions, mul1: 81) cap eval at half the space and give train what is left, which is
less than ``n_train``; a warning says so.

Reward of the procedural tasks: 1.0 when :func:`~tokencredit.data.grading.extract_final_answer` finds a number equal to the
reference (68 == 68.0 == "68."), else 0.0. The parser takes the FINAL answer, because the model
restates the question: ``\\boxed{X}``, then ``#### X``, then "answer is X" / "answer: X", then
the last number that is not an operand (a number followed by an operator, ``=`` or ``?``, or
preceded by a binary operator, is part of a restated expression, not a result).

Prompts are the parameter-free constants ``ARITH_PROMPTS``, ``WORD_PROMPT``, ``DATASET_PROMPT``
and ``SYSTEM_PROMPT`` below, so they can be tuned in one place (prompt wording changes the small
model's accuracy a lot).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import random
import threading
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .datasource import DatasetError, Example, load_task_rows
from .grading import (
    RewardValueError,
    answers_match,
    check_reward,
    extract_final_answer,
    math_reward,
    numeric_reward,
    reference_answer,
)
from .rewards import RewardFnError, load_reward_fn

logger = logging.getLogger(__name__)

__all__ = [
    "ARITH_PROMPTS",
    "DATASET_PROMPT",
    "EVAL_SEED",
    "DatasetError",
    "Example",
    "RewardFnError",
    "RewardValueError",
    "SYSTEM_PROMPT",
    "Task",
    "WORD_PROMPT",
    "answers_match",
    "extract_final_answer",
    "list_tasks",
    "load_reward_fn",
    "make_data_task",
    "response_space",
    "make_task",
    "numeric_reward",
    "math_reward",
    "check_reward",
    "score_safely",
]

# ---------------------------------------------------------------------------------------------
# Prompt constants (tune here; every task builds its user message from these)
# ---------------------------------------------------------------------------------------------

# "Answer with just the number." keeps a 32-token rollout from running out before the answer.
ARITH_PROMPTS: Dict[str, str] = {
    "+": "What is {a} + {b}? Answer with just the number.",
    "*": "What is {a} * {b}? Answer with just the number.",
}
WORD_PROMPT = "{problem} Answer with just the number."
# \boxed{} is what math-verify and the MATH solutions use to mark the final answer.
DATASET_PROMPT = "{problem}\nPut your final answer within \\boxed{{}}."
# None: no system message, the chat template's default applies (SmolLM2 inserts its own).
SYSTEM_PROMPT: Optional[str] = None

# The eval split of the procedural tasks is drawn with this seed whatever the run's seed is.
EVAL_SEED = 1234

# Hub defaults for the dataset tasks: (hub id, config).
DATASET_DEFAULTS: Dict[str, Tuple[str, Optional[str]]] = {
    "gsm8k": ("openai/gsm8k", "main"),  # columns question / answer ("... #### 72")
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default"),  # problem / solution (\boxed{..})
}

MIX_PARTS = ("add1", "add2", "mul1", "word")


# ---------------------------------------------------------------------------------------------
# Data types
# ---------------------------------------------------------------------------------------------


def _messages(question: str) -> tuple:
    msgs = [] if SYSTEM_PROMPT is None else [{"role": "system", "content": SYSTEM_PROMPT}]
    return tuple(msgs + [{"role": "user", "content": question}])


def _example(prefix: str, question: str, answer: str) -> Example:
    digest = hashlib.sha1(question.encode("utf-8")).hexdigest()[:12]
    return Example(id=f"{prefix}-{digest}", question=question, answer=answer, messages=_messages(question))


@dataclass
class Task:
    """Prompts plus a reward. ``scorer(completion, example) -> float`` is what ``reward`` calls;
    ``reward`` accepts only a finite real number within ``reward_range`` (else
    :class:`RewardValueError`, which :func:`score_safely` counts as a failure)."""

    name: str
    train: List[Example]
    eval: List[Example]
    scorer: Callable[[str, Example], float] = field(default=None, repr=False)  # type: ignore[assignment]
    description: str = ""
    reward_range: Tuple[float, float] = (0.0, 1.0)  # eval reports the mean reward as an accuracy
    # the column of an example's row that holds the reference answer (the built-in rewards grade
    # against it); None: the rows have none
    answer_column: Optional[str] = "answer"
    has_default_reward: bool = True  # False: the rows have no answer, reward.funcs must be given
    # own data: where the eval rows come from, {"where", "of": rows there before n_eval,
    # "held_out": a data.eval_fraction hold-out}; None: a built-in task
    eval_source: Optional[Dict[str, Any]] = None
    # responses of a fixed length over a small alphabet (exactvalue.ResponseSpace): the policy's
    # exact values can be enumerated (the true_values signal); None: not enumerable
    response_space: Optional[Any] = None

    def __post_init__(self):
        if self.scorer is None:
            self.scorer = numeric_reward

    def reward(self, completion: str, example: Example) -> float:
        return check_reward(self.scorer(completion, example), self.reward_range)


# ---------------------------------------------------------------------------------------------
# Procedural tasks
# ---------------------------------------------------------------------------------------------

# (operator, operand range) of the enumerated arithmetic tasks; mul1 leaves out 0 (a fifth of
# the products would be 0) and add1 keeps it.
_ARITH = {
    "add1": ("+", range(0, 10)),
    "add2": ("+", range(10, 100)),
    "mul1": ("*", range(1, 10)),
}


def _arith_space(name: str) -> List[Tuple[str, str]]:
    op, rng = _ARITH[name]
    fn = (lambda a, b: a + b) if op == "+" else (lambda a, b: a * b)
    return [(ARITH_PROMPTS[op].format(a=a, b=b), str(fn(a, b))) for a in rng for b in rng]


_NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kofi",
    "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor",
    "Wen", "Yusuf", "Zoe",
)
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards")
_GOODS = (("pen", "pens"), ("notebook", "notebooks"), ("ticket", "tickets"), ("toy car", "toy cars"))


def _w_gets_more(r):
    a, b = r.randint(2, 20), r.randint(2, 20)
    return "{n} has {a} {item}. {n} gets {b} more {item}. How many {item} does {n} have now?", dict(a=a, b=b), a + b


def _w_gives(r):
    a = r.randint(5, 20)
    b = r.randint(1, a - 1)
    return "{n} has {a} {item} and gives {b} of them to {m}. How many {item} does {n} have left?", dict(a=a, b=b), a - b


def _w_bags(r):
    a, b = r.randint(2, 6), r.randint(2, 9)
    return "{n} buys {a} bags of {item}. Each bag has {b} {item}. How many {item} does {n} buy in total?", dict(a=a, b=b), a * b


def _w_coins(r):
    a, b = r.randint(3, 15), r.randint(3, 15)
    c = r.randint(1, a + b - 1)
    return ("{n} has {a} coins in a jar and {b} coins in a pocket, then spends {c} coins. "
            "How many coins does {n} have left?"), dict(a=a, b=b, c=c), a + b - c


def _w_more_than(r):
    a, b = r.randint(2, 12), r.randint(1, 8)
    return ("{n} has {a} {item}. {m} has {b} more {item} than {n}. "
            "How many {item} do they have together?"), dict(a=a, b=b), 2 * a + b


def _w_pages(r):
    a, b = r.randint(2, 9), r.randint(2, 7)
    return "{n} reads {a} pages every day. How many pages does {n} read in {b} days?", dict(a=a, b=b), a * b


def _w_birds(r):
    a = r.randint(5, 20)
    b, c = r.randint(1, a - 1), r.randint(1, 10)
    return ("There are {a} birds on a tree. {b} birds fly away, then {c} birds land on the tree. "
            "How many birds are on the tree now?"), dict(a=a, b=b, c=c), a - b + c


def _w_share(r):
    b, k = r.randint(2, 6), r.randint(2, 9)
    return "{n} shares {a} {item} equally among {b} friends. How many {item} does each friend get?", dict(a=b * k, b=b), k


def _w_eggs(r):
    a, b = r.choice((6, 10, 12)), r.randint(2, 5)
    c = r.randint(1, a - 1)
    return "A box holds {a} eggs. {n} has {b} full boxes and {c} loose eggs. How many eggs does {n} have?", dict(a=a, b=b, c=c), a * b + c


def _w_cost(r):
    a, b = r.randint(2, 9), r.randint(2, 9)
    one, many = r.choice(_GOODS)
    return f"One {one} costs {{a}} dollars. How many dollars do {{b}} {many} cost?", dict(a=a, b=b), a * b


def _w_earns(r):
    a, b = r.randint(5, 30), r.randint(5, 30)
    return ("{n} earns {a} dollars on Monday and {b} dollars on Tuesday. "
            "How many dollars does {n} earn in total?"), dict(a=a, b=b), a + b


def _w_lost_found(r):
    a = r.randint(5, 20)
    b, c = r.randint(1, a - 1), r.randint(1, 10)
    return ("{n} had {a} {item}. {n} lost {b} of them and then found {c} more. "
            "How many {item} does {n} have now?"), dict(a=a, b=b, c=c), a - b + c


_WORD_TEMPLATES = {
    "gets_more": _w_gets_more, "gives": _w_gives, "bags": _w_bags, "coins": _w_coins,
    "more_than": _w_more_than, "pages": _w_pages, "birds": _w_birds, "share": _w_share,
    "eggs": _w_eggs, "cost": _w_cost, "earns": _w_earns, "lost_found": _w_lost_found,
}


def _word_sample(r: random.Random) -> Tuple[str, str, str]:
    key = r.choice(sorted(_WORD_TEMPLATES))
    text, nums, answer = _WORD_TEMPLATES[key](r)
    n, m = r.sample(_NAMES, 2)
    problem = text.format(n=n, m=m, item=r.choice(_ITEMS), **nums)
    return key, WORD_PROMPT.format(problem=problem), str(answer)


def _sample_unique(r: random.Random, k: int, taken: set, prefix: str) -> List[Example]:
    """k word problems not in ``taken`` (rejection sampling; gives up after 50 tries per item)."""
    out: List[Example] = []
    tries = 0
    while len(out) < k and tries < 50 * k + 100:
        tries += 1
        key, question, answer = _word_sample(r)
        if question in taken:
            continue
        taken.add(question)
        out.append(_example(f"{prefix}-{key}", question, answer))
    return out


# Multi-step chains (task "chain", issue 10): a + b - c with a, b, c in 2..9 and a positive
# result, solved in two written steps. The worked example is a previous chat turn (a one-shot
# dialogue), not text inside the question: with the example in the question the embedded model
# copied its answer or restated the expression (pass@1 0.02-0.06 on 48 samples at T = 0.7);
# as a previous turn it follows the format (pass@1 ~0.4, responses ~32 tokens; docs/fidelity.md).
# The intermediate sum decides the outcome, so credit placement is not trivial.
CHAIN_PROMPT = "Compute {a} + {b} - {c}."
# (question, worked answer) turns shown before the question; its "Answer: N" line is what
# extract_final_answer's "answer:" marker reads.
CHAIN_SHOTS: Tuple[Tuple[str, str], ...] = (
    (CHAIN_PROMPT.format(a=3, b=4, c=5), "Step 1: 3 + 4 = 7\nStep 2: 7 - 5 = 2\nAnswer: 2"),
)


def _chain_space() -> List[Tuple[str, str]]:
    r = range(2, 10)
    shown = {q for q, _ in CHAIN_SHOTS}
    return [(q, str(a + b - c)) for a in r for b in r for c in r
            if a + b - c > 0 and (q := CHAIN_PROMPT.format(a=a, b=b, c=c)) not in shown]


def _chain_example(question: str, answer: str) -> Example:
    ex = _example("chain", question, answer)
    shots = []
    for q, a in CHAIN_SHOTS:
        shots += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    msgs = list(ex.messages)
    return replace(ex, messages=tuple(msgs[:-1] + shots + msgs[-1:]))


def _warn_short(name: str, split: str, got: int, asked: int, space: Any) -> None:
    if got < asked:
        logger.warning(
            "task %s: %s split has %d examples, fewer than the %d asked (question space %s)",
            name, split, got, asked, space,
        )


def _procedural(name: str, seed: int, n_train: int, n_eval: int) -> Tuple[List[Example], List[Example]]:
    if name in _ARITH or name == "chain":
        space = _arith_space(name) if name in _ARITH else _chain_space()
        random.Random(f"{name}-eval-{EVAL_SEED}").shuffle(space)
        n_ev = min(n_eval, len(space) // 2)
        make = _chain_example if name == "chain" else partial(_example, name)
        ev = [make(q, a) for q, a in space[:n_ev]]
        rest = space[n_ev:]
        random.Random(f"{name}-train-{seed}").shuffle(rest)
        tr = [make(q, a) for q, a in rest[:n_train]]
        _warn_short(name, "eval", len(ev), n_eval, len(space))
        _warn_short(name, "train", len(tr), n_train, len(space))
        return tr, ev
    if name == "word":
        taken: set = set()
        ev = _sample_unique(random.Random(f"word-eval-{EVAL_SEED}"), n_eval, taken, "word")
        tr = _sample_unique(random.Random(f"word-train-{seed}"), n_train, taken, "word")
        _warn_short(name, "eval", len(ev), n_eval, "templates")
        _warn_short(name, "train", len(tr), n_train, "templates")
        return tr, ev
    if name == "mix":
        tr, ev = [], []
        k = len(MIX_PARTS)
        for i, part in enumerate(MIX_PARTS):  # equal shares, the remainder to the first parts
            ptr, pev = _procedural(part, seed, n_train // k + (i < n_train % k), n_eval // k + (i < n_eval % k))
            tr += ptr
            ev += pev
        random.Random(f"mix-eval-{EVAL_SEED}").shuffle(ev)
        random.Random(f"mix-train-{seed}").shuffle(tr)
        return tr, ev
    raise AssertionError(name)


# ---------------------------------------------------------------------------------------------
# Dataset tasks (gsm8k, math)
# ---------------------------------------------------------------------------------------------

def _rows_to_examples(name: str, rows: Sequence[Dict[str, Any]], where: str) -> List[Example]:
    out, seen, skipped = [], set(), 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"task.path: expected each row of {where} to be an object with named columns, row {i + 1} is {type(row).__name__}")
        problem = row.get("question", row.get("problem"))
        answer = reference_answer(row)
        if not isinstance(problem, str) or not problem.strip() or answer is None:
            skipped += 1
            continue
        question = DATASET_PROMPT.format(problem=problem.strip())
        if question in seen:  # duplicates would break the disjoint split
            continue
        seen.add(question)
        out.append(_example(name, question, answer))
    if not rows or not out:
        raise DatasetError(
            f"task.path: expected rows with columns question/answer or problem/solution (or problem/answer) "
            f"in {where}, got {len(rows)} rows and {len(out)} usable"
        )
    if skipped:
        logger.warning("task %s: skipped %d rows of %s without a question or an answer", name, skipped, where)
    return out



def _dataset_task(name: str, seed: int, n_train: int, n_eval: int, path: Optional[str]) -> Tuple[List[Example], List[Example]]:
    train_rows, eval_rows, where = load_task_rows(name, path, DATASET_DEFAULTS[name])
    train_pool = _rows_to_examples(name, train_rows, where)
    if eval_rows is not None:
        ev = _rows_to_examples(name, eval_rows, where)[:n_eval]  # a given test split: its first rows
        ev_q = {e.question for e in ev}
        train_pool = [e for e in train_pool if e.question not in ev_q]
    else:  # one file: a fixed permutation, eval first (at most half), train from the rest
        random.Random(f"{name}-eval-{EVAL_SEED}").shuffle(train_pool)
        n_ev = min(n_eval, len(train_pool) // 2)
        ev, train_pool = train_pool[:n_ev], train_pool[n_ev:]
    random.Random(f"{name}-train-{seed}").shuffle(train_pool)
    tr = train_pool[:n_train]
    _warn_short(name, "eval", len(ev), n_eval, where)
    _warn_short(name, "train", len(tr), n_train, where)
    return tr, ev


# ---------------------------------------------------------------------------------------------
# Public constructors
# ---------------------------------------------------------------------------------------------

_DESCRIPTIONS = {
    "add1": "1-digit addition (a, b in 0..9), 100 questions",
    "add2": "2-digit addition (a, b in 10..99), 8100 questions",
    "mul1": "1-digit multiplication (a, b in 1..9), 81 questions",
    "word": f"1-2 step word problems from {len(_WORD_TEMPLATES)} templates",
    "mix": "equal shares of " + ", ".join(MIX_PARTS),
    "chain": "two-step chains a + b - c > 0 (a, b, c in 2..9) solved step by step after a worked example turn, 455 questions",
    "keytok": "key tokens: 3 of 8 letters decide the reward, 5 are free (controlled, enumerable)",
    "carry": "2-bit binary addition written out column by column; the answer bits decide, the work is free (controlled, enumerable)",
    "fork": "forking token: the first of 6 letters decides the outcome, 5 free letters follow (controlled, enumerable)",
    "gsm8k": "GSM8K (hub openai/gsm8k or a local file), math-verify reward",
    "math": "MATH (hub DigitalLearningGmbH/MATH-lighteval or a local file), math-verify reward",
}


def list_tasks() -> List[str]:
    return list(_DESCRIPTIONS)


def make_task(
    name: str,
    *,
    seed: int = 0,
    n_train: int = 512,
    n_eval: int = 64,
    path: Optional[str] = None,
    reward_fn: Optional[str] = None,
) -> Task:
    """Build a task by name; ``reward_fn="pkg.mod:fn"`` replaces its reward."""
    if name not in _DESCRIPTIONS:
        raise ValueError(f"task name: expected one of {list_tasks()}, got {name!r}")
    if not isinstance(n_train, int) or n_train < 1:
        raise ValueError(f"n_train: expected an int >= 1, got {n_train!r}")
    if not isinstance(n_eval, int) or n_eval < 0:
        raise ValueError(f"n_eval: expected an int >= 0, got {n_eval!r}")
    space = response_space(name)
    if space is not None:
        from . import controlled

        if path is not None:
            raise ValueError(f"path: only the dataset tasks {sorted(DATASET_DEFAULTS)} read a path; task {name!r} got {path!r}")
        train, eval_ = controlled.build(name, seed, n_train, n_eval)
        scorer: Callable[[str, Example], float] = controlled.REWARDS[name]
    elif name in DATASET_DEFAULTS:
        train, eval_ = _dataset_task(name, seed, n_train, n_eval, path)
        scorer = math_reward
    else:
        if path is not None:
            raise ValueError(f"path: only the dataset tasks {sorted(DATASET_DEFAULTS)} read a path; task {name!r} got {path!r}")
        train, eval_ = _procedural(name, seed, n_train, n_eval)
        scorer = numeric_reward
    task = Task(name=name, train=train, eval=eval_, scorer=scorer, description=_DESCRIPTIONS[name], response_space=space)
    if reward_fn is not None:
        task = replace(task, scorer=load_reward_fn(reward_fn), response_space=None)
    return task


def response_space(name: str) -> Optional[Any]:
    """The enumerable response space of task ``name`` (a controlled task), else None."""
    from .controlled import CONTROLLED

    return CONTROLLED[name].space if name in CONTROLLED else None


# ---------------------------------------------------------------------------------------------
# Safe scoring
# ---------------------------------------------------------------------------------------------

_LOGGED_FAILURES: set = set()


def _log_failure_once(fn: Callable, kind: str, exc: Optional[BaseException]) -> None:
    key = (getattr(fn, "__qualname__", repr(fn)), kind, type(exc).__name__ if exc else None)
    if key in _LOGGED_FAILURES:
        return
    _LOGGED_FAILURES.add(key)
    if exc is not None:
        logger.warning("reward %s failed (%s); scored 0.0 (logged once per kind)", key[0], kind, exc_info=exc)
    else:
        logger.warning("reward %s %s; scored 0.0 (logged once per kind)", key[0], kind)


def _as_reward(fn: Callable, value: Any) -> Tuple[float, Optional[str]]:
    try:
        return check_reward(value), None
    except RewardValueError as e:
        _log_failure_once(fn, "error", e)
        return 0.0, "error"


def score_safely(
    fn: Callable[[str, Example], float], completion: str, example: Example, timeout_s: Optional[float]
) -> Tuple[float, Optional[str]]:
    """``(reward, failure)`` with failure None, "error" or "timeout"; never raises for fn's sake.

    An exception, a non-numeric or non-finite result scores 0.0 with "error"; a call still running
    after ``timeout_s`` seconds scores 0.0 with "timeout". Each call runs in its own daemon thread
    and waits on a ``concurrent.futures.Future``: a timed-out call is ABANDONED, NOT KILLED (Python
    cannot kill a thread). It keeps running in the background, holding the GIL for its share of
    CPU, but neither blocks later calls (no shared worker to clog) nor keeps the process alive at
    exit (daemon). Rewards that may hang for good belong in a subprocess the function manages.
    ``timeout_s=None`` calls fn inline, without a timeout (errors still score 0.0).
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s: expected > 0 or None, got {timeout_s!r}")
    if timeout_s is None:
        try:
            return _as_reward(fn, fn(completion, example))
        except (Exception, SystemExit) as e:
            _log_failure_once(fn, "error", e)
            return 0.0, "error"

    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(completion, example))
        except BaseException as e:  # delivered to the caller, which decides
            future.set_exception(e)

    threading.Thread(target=run, name="tokencredit-reward", daemon=True).start()
    # wait() rather than result(timeout): a TimeoutError raised BY fn must count as "error"
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    if not done:
        _log_failure_once(fn, f"timed out after {timeout_s} s", None)
        return 0.0, "timeout"
    exc = future.exception()
    if exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            raise exc
        _log_failure_once(fn, "error", exc)
        return 0.0, "error"
    return _as_reward(fn, future.result())


def make_data_task(data: Any, *, seed: int = 0, n_train: int = 512, n_eval: int = 64, hold_out: bool = True) -> Task:
    """The task of own data (``data``: a ``DataConfig``, :func:`tokencredit.data.datasource.load_own_data`;
    ``hold_out=False``: data without an eval split is evaluated whole): its reward, unless
    ``reward.funcs`` replace it, is math-verify against the answer column."""
    from .datasource import load_own_data

    d = load_own_data(data, seed=seed, n_train=n_train, n_eval=n_eval, hold_out=hold_out)
    return Task(name="data", train=d.train, eval=d.eval, scorer=math_reward, description=f"own data from {d.where}",
                answer_column=d.answer_column, has_default_reward=d.answer_column is not None,
                eval_source={"where": d.eval_where, "of": d.eval_of, "held_out": d.held_out})
