"""Reward functions as TRL writes them, and the guarded calls that run them.

**The contract** is TRL's (``trl.GRPOTrainer``'s custom reward functions), so one function works
in ``tokencredit train``, in :class:`~tokencredit.integrations.trl.TokenCreditGRPOTrainer` and,
through :mod:`tokencredit.integrations.verl.rewards`, in verl::

    def correct(prompts, completions, completion_ids, solution, **kwargs) -> list[float | None]

``prompts`` and ``completions`` are texts, or chat messages for conversational data (a
completion is then ``[{"role": "assistant", "content": text}]``); ``completion_ids`` the token
ids; every other column of the row comes as a keyword argument holding one value per completion
(a prompt's K samples repeat its row; a verl-layout row as the verl adapter reads it:
``ground_truth``, ``data_source``, ``extra_info`` and its keys, :func:`reward_columns`), plus
``trainer_state`` (``global_step``, ``max_steps``),
``log_metric(name, value)`` (logged as ``rewards/extra/NAME``) and ``log_extra`` (accepted,
ignored). It returns one float (any range) per completion, or ``None`` for "not applicable".
``--reward.funcs mod:fn file.py:fn math numeric`` names them (built-ins: :data:`BUILTINS`),
``--reward.weights`` weighs them; the reward of a completion is the weighted sum over the
functions that scored it (``nansum``, TRL's ``sum_then_normalize``).

**The guard.** Every call runs in a worker *process* (``multiprocessing`` with the forkserver
start method, spawn where there is none), so a call that passes its budget is ended, not
abandoned: the worker is killed and a fresh one takes the next call. A call's budget is
``timeout_s`` per completion it scores. The worker ignores Ctrl-C (the trainer decides), is a
daemon process (it cannot keep a finished run alive) and leads its own session: it is killed as a
process group, so what a function starts (a ``fork()``, a subprocess it waits on) ends with it.
It receives its arguments pickled, so each call works on its own copy of the rows: a function
that mutates ``kwargs["prompt"]`` changes nothing the trainer sees. A function's module is
imported and checked in the worker, never in the trainer's process (:func:`load_reward_funcs`,
:func:`load_reward_fn`), bounded separately (:data:`LOAD_TIMEOUT_S`), so a slow import does not
count against a call and one that hangs is ended in one line.

**Failures.** A call that raises, returns the wrong number of values or passes its budget fails
for every completion it was given; a value that is not a finite real number (a string ``"1.0"``,
NaN) fails for its completion. A failed value counts as "not scored" (NaN, left out of the
weighted sum like ``None``) and is counted (``reward/failed_error``, ``reward/failed_timeout``,
``rewards/NAME/failed``). A function that fails on every completion of ``max_failing_steps``
consecutive training steps, or of every step of a shorter run (at its last step), stops the run
with :class:`RewardFailure`, one line naming the function, the row and the exception. A return
value that is a dict is refused (never read by its keys); a function that returns None for every
completion of a step is warned about once.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import os
import signal
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import RewardFailure, RewardFnError  # noqa: F401 (defined in errors; importable here too)
from .grading import (
    BUILTINS,
    RewardValueError,
    check_reward,
    completion_text,
    gold_answer,
    math_accuracy,
    math_reward,
    math_verify_equal,
    numeric_accuracy,
)
from .reward_metrics import completion_metrics, reward_metrics  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTINS",
    "LOAD_TIMEOUT_S",
    "RewardFailure",
    "RewardFnError",
    "RewardFunc",
    "RewardRunner",
    "RewardScores",
    "load_reward_fn",
    "completion_metrics",
    "load_reward_funcs",
    "math_accuracy",
    "numeric_accuracy",
    "per_sample_func",
    "answer_key",
    "checked_values",
    "resolve_ref",
    "reward_columns",
    "reward_metrics",
    "runner_for",
    "user_code",
]

#: seconds a worker may take to import a reward function's module (not counted against a call)
LOAD_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------------------------
# The columns a function receives
# ---------------------------------------------------------------------------------------------

#: what verl's reward managers add to a row's ``extra_info`` (left out where empty: not data)
_VERL_ADDED = {"num_turns": None, "rollout_reward_scores": {}}


def reward_columns(row: Mapping[str, Any]) -> Dict[str, Any]:
    """A row's columns as reward functions receive them, the same in ``train``,
    ``TokenCreditGRPOTrainer`` and verl (:mod:`tokencredit.integrations.verl.rewards`, whose
    reading of verl's layout is the reference). A verl-layout row (``reward_model`` a mapping
    with ``ground_truth``) gives ``ground_truth``, ``data_source``, ``extra_info`` (as a mapping)
    and each ``extra_info`` key as a column (a row column of that name wins); ``reward_model``
    itself is not passed (verl passes only its ground truth), nor what verl's reward manager adds
    to ``extra_info`` when empty (``num_turns``, ``rollout_reward_scores``). Any other row is
    passed as it is (TRL: every column). A new dict."""
    rm = row.get("reward_model")
    if not (isinstance(rm, Mapping) and "ground_truth" in rm):
        return dict(row)
    out = {k: v for k, v in row.items() if k != "reward_model"}
    extra = row.get("extra_info")
    if isinstance(extra, Mapping):
        extra = {str(k): v for k, v in extra.items() if not (k in _VERL_ADDED and v == _VERL_ADDED[k])}
        out["extra_info"] = extra
        for k, v in extra.items():
            out.setdefault(k, v)
    out["ground_truth"] = rm["ground_truth"]
    return out


def answer_key(answer_column: Optional[str]) -> Optional[str]:
    """The keyword argument that holds the reference answer of the column ``answer_column``
    (``data.answer_column``): verl's ``reward_model.ground_truth`` is ``ground_truth``
    (:func:`reward_columns`)."""
    return "ground_truth" if answer_column == "reward_model.ground_truth" else answer_column


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


_SPEC_HINT = "expected 'package.module:function' or 'file.py:function'"


def _parse_target(import_path: str, field_name: str) -> tuple:
    """'pkg.mod:fn' / 'path/file.py:fn' / 'mod:Class.method' -> the reference a worker process
    loads it by, importing nothing: ``("file", path, attr)`` or ``("module", name, attr, local)``,
    ``local`` the file ``name`` names relative to the current directory (``my_rewards:fn`` next
    to the data), loaded when no module of that name can be imported."""
    if not isinstance(import_path, str) or ":" not in import_path:
        raise RewardFnError(f"{field_name}: {_SPEC_HINT}, got {import_path!r}")
    module_name, _, attr = import_path.rpartition(":")
    if not module_name or not attr:
        raise RewardFnError(f"{field_name}: {_SPEC_HINT}, got {import_path!r}")
    if module_name.endswith(".py"):
        return ("file", os.path.abspath(module_name), attr)
    local = Path(*module_name.split(".")).with_suffix(".py")
    return ("module", module_name, attr, str(local.resolve()) if local.is_file() else None)


class _MissingAttribute(AttributeError):
    """The module has no such attribute (told apart from an AttributeError its import raised)."""


def _info_of(obj: Any) -> Dict[str, Any]:
    """What the trainer checks of a loaded function (computed where it was imported: the worker)."""
    info: Dict[str, Any] = {"callable": callable(obj), "type": type(obj).__name__, "name": _callable_name(obj),
                            "params": None, "var_kw": False, "binds_pair": None}
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return info
    info["params"] = list(sig.parameters)
    info["var_kw"] = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    try:
        sig.bind("completion", None)
        info["binds_pair"] = ""
    except TypeError as e:
        info["binds_pair"] = str(e)
    return info


class _LoadError(Exception):
    """A function that cannot be loaded; ``str()`` is the one line to show."""


def _load(ref: tuple) -> Tuple[Callable, Dict[str, Any]]:
    """Import ``ref``'s function in this process (the worker) -> (it, :func:`_info_of` it); a
    failure is a :class:`_LoadError` naming the module."""
    try:
        fn = resolve_ref(ref)
    except _MissingAttribute as e:
        raise _LoadError(str(e)) from None
    except Exception as e:
        raise _LoadError(f"cannot import module {ref[1]!r} ({_describe(e)})") from None
    return fn, _info_of(fn)


def _load_file_module(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path!r}")
    name = f"tokencredit_user_{abs(hash(path)):x}_{Path(path).stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling of the module's objects finds it
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def resolve_ref(ref: tuple) -> Any:
    """A reference (see :func:`_parse_target`, :class:`RewardFunc`) -> the callable."""
    kind = ref[0]
    if kind == "object":
        return ref[1]
    if kind == "builtin":
        if ref[1] == "math":
            _warm_math_verify()
        return partial(BUILTINS[ref[1]], answer_column=ref[2])
    if kind == "per_sample":
        inner = resolve_ref(ref[1])
        if inner is math_reward:
            _warm_math_verify()
        return partial(_per_sample, inner, ref[2])
    if kind == "module":
        try:
            module = importlib.import_module(ref[1])
        except ModuleNotFoundError as e:  # no such module: the file of that name, if there is one
            local = ref[3] if len(ref) > 3 else None
            if local is None or not (e.name == ref[1] or ref[1].startswith(f"{e.name}.")):
                raise
            module = _load_file_module(local)
    else:
        module = _load_file_module(ref[1])
    obj: Any = module
    for part in ref[2].split("."):
        if not hasattr(obj, part):
            raise _MissingAttribute(f"module {ref[1]!r} has no attribute {ref[2]!r}")
        obj = getattr(obj, part)
    return obj


def _warm_math_verify() -> None:
    """math-verify's first call imports sympy and its LaTeX parser (seconds): done when a function
    is loaded, so that it does not count against the first call's budget."""
    try:
        math_verify_equal("1", "\\boxed{1}")
    except ImportError:
        pass


def _loaded_info(specs_refs: Sequence[Tuple[int, str, tuple]], field_name: str, worker: Optional["_Worker"] = None,
                 in_process: bool = False) -> Dict[int, Dict[str, Any]]:
    """Import each ``(key, spec, ref)`` and return its :func:`_info_of` by key: in ``worker`` (a
    temporary one when None, ended after), each import bounded by :data:`LOAD_TIMEOUT_S`, so that
    user code never runs in this process; ``in_process``: here (verl's reward process, which
    imports its ``custom_reward_function`` itself). One line naming the function for a failure."""
    out: Dict[int, Dict[str, Any]] = {}
    if in_process:
        for key, spec, ref in specs_refs:
            try:
                out[key] = _load(ref)[1]
            except _LoadError as e:
                raise RewardFnError(f"{field_name} {spec!r}: {e}") from None
        return out
    w = worker if worker is not None else _Worker()
    try:
        for key, spec, ref in specs_refs:
            reply = w.request(("load", key, ref, list(sys.path), os.getcwd()), LOAD_TIMEOUT_S)
            if reply is None:
                raise RewardFnError(f"{field_name} {spec!r}: importing it in the reward worker took more than "
                                    f"{LOAD_TIMEOUT_S:g} s and was ended")
            if reply[0] != "ok":
                raise RewardFnError(f"{field_name} {spec!r}: {_one_line(str(reply[1]))}")
            w.loaded.add(key)
            out[key] = reply[1]
    except BaseException:
        w.kill()
        raise
    finally:
        if worker is None:
            w.kill()
    return out


class _UserFunction:
    """A user's function by reference, imported where it is first called: the trainer hands the
    reference to its reward worker and never calls it itself (``__tokencredit_ref__``)."""

    def __init__(self, ref: tuple, name: str):
        self.__tokencredit_ref__ = ref
        self.__name__ = self.__qualname__ = name
        self._fn: Optional[Callable] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            self._fn = resolve_ref(self.__tokencredit_ref__)
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<reward function {self.__name__} from {self.__tokencredit_ref__[1]}>"


def load_reward_fn(import_path: str) -> Callable:
    """A per-completion reward ``fn(completion, example) -> float`` (``task.reward_fn``), by
    'package.module:function' or 'path/to/file.py:function', imported and checked in a reward
    worker process (never here): the callable returned imports it where it is first called. A
    function written for TRL's contract (``completions`` first, or only keyword arguments) is
    refused with a pointer to ``--reward.funcs``."""
    ref = _parse_target(import_path, "reward_fn")
    info = _loaded_info([(0, import_path, ref)], "reward_fn")[0]
    if not info["callable"]:
        raise RewardFnError(f"reward_fn {import_path!r}: {ref[2]!r} is a {info['type']}, not callable")
    names = info["params"]
    if names is not None:
        if names and names[0] in ("prompts", "completions", "completion_ids"):
            raise RewardFnError(
                f"reward_fn {import_path!r}: takes TRL's arguments ({names[0]}, ...); give it as "
                f"--reward.funcs {import_path} (task.reward_fn takes fn(completion, example))"
            )
        if info["binds_pair"]:
            raise RewardFnError(f"reward_fn {import_path!r}: must accept (completion, example), its signature does not "
                                f"({info['binds_pair']})")
    return _UserFunction(ref, info["name"])


@dataclass
class RewardFunc:
    """One reward function as the runner calls it: a display ``name`` (TRL's: the function's
    ``__name__``), the ``ref`` a worker loads it by, its ``weight``; ``per_sample`` functions take
    ``(completion, example)`` and must return a number in ``reward_range``."""

    name: str
    ref: tuple
    weight: float = 1.0
    spec: str = ""  # what the user wrote (messages name it)
    per_sample: bool = False


def _callable_name(fn: Any) -> str:
    while isinstance(fn, partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def load_reward_funcs(specs: Sequence[str], weights: Sequence[float] = (), answer_column: str = "answer", *,
                      worker: Optional["_Worker"] = None, in_process: bool = False) -> List[RewardFunc]:
    """``--reward.funcs`` / ``--reward.weights`` -> the functions, each imported and checked now
    (before any model loads) in a reward worker process (``worker``, which keeps them loaded for
    the run; a temporary one when None), never in this one (``in_process``: here, for verl's
    reward process): a built-in name (:data:`BUILTINS`, grading against ``answer_column``),
    'package.module:function' or 'file.py:function' taking TRL's keyword arguments. One line
    naming the function for anything that cannot work."""
    if weights and len(weights) != len(specs):
        raise RewardFnError(f"reward.weights: expected {len(specs)} weights, one per reward.funcs entry, got {len(weights)}")
    out: List[RewardFunc] = []
    user: List[Tuple[int, str, tuple]] = []
    for i, spec in enumerate(specs):
        w = float(weights[i]) if weights else 1.0
        if not isinstance(spec, str) or not spec.strip():
            raise RewardFnError(f"reward.funcs: expected a built-in name ({', '.join(BUILTINS)}) or 'module:function', got {spec!r}")
        if spec in BUILTINS:
            out.append(RewardFunc(name=spec, ref=("builtin", spec, answer_column), weight=w, spec=spec))
            continue
        if ":" not in spec:
            raise RewardFnError(f"reward.funcs: expected a built-in name ({', '.join(BUILTINS)}) or 'module:function', got {spec!r}")
        ref = _parse_target(spec, "reward.funcs")
        user.append((i, spec, ref))
        out.append(RewardFunc(name=ref[2].rsplit(".", 1)[-1], ref=ref, weight=w, spec=spec))
    infos = _loaded_info(user, "reward.funcs", worker, in_process) if user else {}
    for i, info in infos.items():
        f = out[i]
        if not info["callable"]:
            raise RewardFnError(f"reward.funcs {f.spec!r}: {f.ref[2]!r} is a {info['type']}, not callable")
        params = info["params"]
        if params is not None and "completions" not in params and not info["var_kw"]:
            raise RewardFnError(
                f"reward.funcs {f.spec!r}: expected a function of TRL's keyword arguments (prompts, completions, "
                f"completion_ids, the row's columns, **kwargs), got one with parameters ({', '.join(params)})"
            )
        f.name = info["name"]
    names = [f.name for f in out]
    for f in out:  # two functions of one name would log into one metric
        if names.count(f.name) > 1:
            f.name = f.spec.replace(":", ".")
    return out


def per_sample_func(fn: Callable, reward_range: Optional[Tuple[float, float]], name: Optional[str] = None) -> RewardFunc:
    """A per-completion grader ``fn(completion, example) -> float`` (a task's reward, or
    ``task.reward_fn``) as a :class:`RewardFunc`: called once per completion inside one worker
    call, each value checked against ``reward_range``."""
    inner = getattr(fn, "__tokencredit_ref__", None) or ("object", fn)
    return RewardFunc(name=name or _callable_name(fn), ref=("per_sample", inner, reward_range), spec=_callable_name(fn),
                      per_sample=True)


# ---------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------

_FAIL = "__tokencredit_failed__"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(e: BaseException) -> str:
    return _one_line(f"{type(e).__name__}: {e}")


def _per_sample(fn: Callable, reward_range, completions, examples, **_: Any) -> list:
    """One worker call of a per-completion grader: each completion on its own, a failure (an
    exception, a value that is no finite number in range) for that completion only."""
    out = []
    for c, ex in zip(completions, examples):
        try:
            out.append(check_reward(fn(completion_text(c), ex), reward_range))
        except BaseException as e:  # noqa: BLE001 - user code; reported, never raised here
            out.append((_FAIL, _describe(e)))
    return out


def checked_values(values: Any, n: int) -> list:
    """A reward function's return value as ``n`` entries: a float, None, or a failure marker ``(_FAIL, why)``."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        # a dict is refused, never read by its keys (verl's {"score": ...} belongs to verl's compute_score)
        raise RewardValueError(f"expected a list of {n} floats (or None), one per completion, got {type(values).__name__} "
                               f"{values!r:.60}")
    values = list(values)
    if len(values) != n:
        raise RewardValueError(f"returned {len(values)} values for {n} completions (expected one per completion)")
    out = []
    for v in values:
        if v is None or (isinstance(v, tuple) and len(v) == 2 and v[0] == _FAIL):
            out.append(v)
            continue
        try:
            out.append(check_reward(v))
        except RewardValueError as e:
            out.append((_FAIL, str(e)))
    return out


def _worker_main(conn) -> None:
    """The worker's loop: ("load", key, ref, sys_path, cwd) and ("call", key, kwargs, n)."""
    # a session (and process group) of its own: whatever a reward function starts (a plain
    # fork(), a subprocess it waits on) is in it, and the group is killed with the worker
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    funcs: Dict[Any, Callable] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if msg[0] == "load":
                _, key, ref, sys_path, cwd = msg
                sys.path[:] = sys_path
                if os.getcwd() != cwd:
                    os.chdir(cwd)
                try:
                    funcs[key], info = _load(ref)
                except _LoadError as e:
                    conn.send(("error", str(e), traceback.format_exc()))
                    continue
                conn.send(("ok", info, None))
            else:
                _, key, kwargs, n = msg
                metrics: Dict[str, float] = {}
                kwargs["log_metric"] = lambda name, value: metrics.__setitem__(str(name), float(value))
                kwargs["log_extra"] = lambda *a, **k: None
                values = checked_values(funcs[key](**kwargs), n)
                conn.send(("ok", values, metrics))
        except BaseException as e:  # noqa: BLE001 - user code: reported to the parent
            try:
                conn.send(("error", _describe(e), traceback.format_exc()))
            except Exception:  # an unpicklable exception text cannot happen (strings); a closed pipe can
                return


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # the server imports tokencredit (and torch) once; each worker is a cheap fork of it
        ctx.set_forkserver_preload(["tokencredit.data.rewards"])
        return ctx
    return multiprocessing.get_context("spawn")


class _Worker:
    """One daemon worker process and its pipe; killed and replaced after a timeout."""

    def __init__(self):
        self.proc = None
        self.conn = None
        self.loaded: set = set()
        self._finalizer = None

    def _start(self) -> None:
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="tokencredit-reward")
        proc.start()
        child.close()
        self.proc, self.conn, self.loaded = proc, parent, set()
        self._finalizer = weakref.finalize(self, _kill, proc, parent)

    def kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self.conn = self._finalizer = None
        self.loaded = set()

    def request(self, msg: tuple, timeout: float) -> Optional[tuple]:
        """Send ``msg`` and wait up to ``timeout`` seconds for the reply; None on timeout (the
        worker is killed). A worker that died answers ("error", ...)."""
        if self.proc is None:
            self._start()
        try:
            self.conn.send(msg)
            if not self.conn.poll(timeout):
                self.kill()
                return None
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            # the worker closed its end: it has ended (os._exit, a crash); its process group goes
            # first (what it started must not outlive it), then its exit code is collected (the
            # wait returns at once for a process that has exited; one that has not is killed)
            _kill_group(self.proc)
            self.proc.join(timeout=10.0)
            code = self.proc.exitcode
            self.kill()
            return ("error", f"the reward worker process ended (exit code {code})", "")
        except BaseException:  # Ctrl-C while waiting: the worker's reply would be stale
            self.kill()
            raise


def _kill_group(proc) -> None:
    """SIGKILL to the worker's process group (the worker leads it: ``os.setsid``), so that the
    processes a reward function started end with it. Sent before the worker is reaped: while
    any member lives, the group's id cannot be another process's."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group has ended already
        pass


def _kill(proc, conn) -> None:
    try:
        _kill_group(proc)
        if proc.is_alive():
            proc.kill()
        proc.join()
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


@dataclass
class RewardScores:
    """The rewards of one batch. ``values[f][i]``: function f's reward of completion i (NaN when
    it returned None or failed); ``total[i]``: the weighted sum over the functions that scored it
    (0 when none did, TRL's ``nansum``)."""

    names: List[str]
    values: List[List[float]]
    total: List[float]
    failed: Dict[str, int]  # completions whose score failed, by kind: error / timeout
    failed_per_func: List[int]
    all_failed: List[bool]  # function f failed on every completion of the batch
    first_failure: List[Optional[str]]  # function f's first failure: "row R: Exception: message"
    extra: Dict[str, float] = field(default_factory=dict)  # log_metric values
    all_none: List[bool] = field(default_factory=list)  # function f returned None for every completion


class RewardRunner:
    """Calls reward functions on batches, each call in a killable worker process.

    ``score(completions, completion_ids, examples, prompts)`` calls every function once on the
    batch; ``end_step(scores)`` records a training step's batches and raises
    :class:`RewardFailure` once a function has failed on every completion of
    ``max_failing_steps`` consecutive steps. ``close()`` ends the worker (also done at exit)."""

    def __init__(self, funcs: Sequence[RewardFunc], timeout_s: float = 5.0, max_failing_steps: int = 2,
                 worker: Optional[_Worker] = None):
        if not funcs:
            raise ValueError("reward funcs: expected at least one reward function, got none")
        self.funcs = list(funcs)
        self.timeout_s = float(timeout_s)
        self.max_failing_steps = int(max_failing_steps)
        self._worker = worker if worker is not None else _Worker()  # (load_reward_funcs' worker: loaded already)
        self._streak = [0] * len(self.funcs)
        self._worked = [False] * len(self.funcs)  # scored (did not fail) on a completion of some step
        self._steps = 0
        self._warned_none: set = set()
        self._logged: set = set()

    @property
    def names(self) -> List[str]:
        return [f.name for f in self.funcs]

    def close(self) -> None:
        self._worker.kill()

    def _load(self, i: int) -> Optional[str]:
        f = self.funcs[i]
        if i in self._worker.loaded and self._worker.proc is not None:
            return None
        reply = self._worker.request(("load", i, f.ref, list(sys.path), os.getcwd()), LOAD_TIMEOUT_S)
        if reply is None:
            return f"loading it took more than {LOAD_TIMEOUT_S:.0f} s"
        if reply[0] != "ok":
            return f"cannot load it in the reward worker ({reply[1]})"
        self._worker.loaded.add(i)
        return None

    def _call(self, i: int, kwargs: Dict[str, Any], n: int) -> Tuple[str, Any, Any]:
        """("ok", values, metrics) | ("error", message, traceback) | ("timeout", message, None)."""
        problem = self._load(i)
        if problem is not None:
            return ("error", problem, "")
        budget = self.timeout_s * max(n, 1)
        reply = self._worker.request(("call", i, kwargs, n), budget)
        if reply is None:
            return ("timeout", f"TimeoutError: the call on {n} completions passed its {budget:g} s budget and was ended", None)
        return reply

    def score(self, completions: Sequence[Any], completion_ids: Sequence[Sequence[int]], examples: Sequence[Any],
              prompts: Sequence[Any], state: Optional[Dict[str, Any]] = None) -> RewardScores:
        """Every function on one batch: ``completions[i]`` answers ``examples[i]`` (an
        :class:`~tokencredit.data.tasks.Example`: its ``columns()`` are the keyword arguments) after
        ``prompts[i]``."""
        n = len(completions)
        rows = [reward_columns(ex.columns()) for ex in examples]
        keys = list(rows[0]) if rows else []
        F = len(self.funcs)
        values = [[math.nan] * n for _ in range(F)]
        failed = {"error": 0, "timeout": 0}
        failed_per_func, all_failed, first, all_none = [0] * F, [False] * F, [None] * F, [False] * F
        extra: Dict[str, float] = {}
        for fi, f in enumerate(self.funcs):
            if f.per_sample:
                kwargs = {"completions": list(completions), "examples": list(examples)}
            else:
                kwargs = {k: [r.get(k) for r in rows] for k in keys}
                kwargs.update(prompts=list(prompts), completions=list(completions),
                              completion_ids=[list(map(int, c)) for c in completion_ids],
                              trainer_state=SimpleNamespace(**(state or {})))
            status, a, b = self._call(fi, kwargs, n)
            if status != "ok":
                failed["timeout" if status == "timeout" else "error"] += n
                failed_per_func[fi] = n
                all_failed[fi] = n > 0
                first[fi] = f"row {_row_id(examples, 0)}: {a}"
                self._log_once(f, status, a, b)
                continue
            extra.update({f"rewards/extra/{k}": v for k, v in (b or {}).items()})
            bad = none = 0
            for i, v in enumerate(a):
                if isinstance(v, tuple):
                    bad += 1
                    if first[fi] is None:
                        first[fi] = f"row {_row_id(examples, i)}: {v[1]}"
                        self._log_once(f, "error", v[1], None)
                elif v is None:
                    none += 1
                else:
                    values[fi][i] = float(v)
            failed["error"] += bad
            failed_per_func[fi] = bad
            all_failed[fi] = n > 0 and bad == n
            all_none[fi] = n > 0 and none == n
        total = []
        for i in range(n):
            col = [(values[fi][i], self.funcs[fi].weight) for fi in range(F)]
            total.append(sum(v * w for v, w in col if not math.isnan(v)))
        return RewardScores(self.names, values, total, failed, failed_per_func, all_failed, first, extra, all_none)

    def end_step(self, step: int, batches: Sequence[RewardScores], last: bool = False) -> None:
        """Record one training step (its batches). A function that failed on every completion of
        ``max_failing_steps`` consecutive steps raises :class:`RewardFailure`, and so does one that
        failed on every completion of every step of the run at its ``last`` step (a run shorter
        than ``max_failing_steps`` whose reward never worked is an error, not a result). A function
        that returned None for every completion of a step is warned about, once."""
        self._steps += 1
        for fi, f in enumerate(self.funcs):
            failed_all = bool(batches) and all(b.all_failed[fi] for b in batches)
            self._streak[fi] = self._streak[fi] + 1 if failed_all else 0
            self._worked[fi] = self._worked[fi] or not failed_all
            why = None
            if self._streak[fi] >= self.max_failing_steps:
                why = (f"failed on every completion of {self._streak[fi]} consecutive steps "
                       f"(reward.max_failing_steps {self.max_failing_steps})")
            elif last and not self._worked[fi]:
                why = (f"failed on every completion of every step of the run ({self._steps} step(s), fewer than "
                       f"reward.max_failing_steps {self.max_failing_steps})")
            if why is not None:
                cause = next((b.first_failure[fi] for b in reversed(batches) if b.first_failure[fi]), "?")
                raise RewardFailure(f"reward {f.spec or f.name}: {why}, the run stops at step {step}; {cause}")
            if batches and all(b.all_none[fi] for b in batches if b.all_none) and f.name not in self._warned_none:
                self._warned_none.add(f.name)
                logger.warning(
                    "reward %s: returned None for every completion of step %d (None is \"not applicable\", as in TRL: "
                    "these completions get no reward from it, and none at all where it is the only function); "
                    "warned once", f.name, step)

    def _log_once(self, f: RewardFunc, kind: str, message: str, tb: Optional[str]) -> None:
        key = (f.name, kind, message.split(":", 1)[0])
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning("reward %s failed (%s): %s; its value is left out (logged once per kind)%s",
                       f.name, kind, message, f"\n{tb}" if tb else "")


def _row_id(examples: Sequence[Any], i: int) -> str:
    ex = examples[i] if i < len(examples) else None
    return str(getattr(ex, "id", i))


# ---------------------------------------------------------------------------------------------
# Building the runner of a run, and TRL's metrics
# ---------------------------------------------------------------------------------------------


def user_code(cfg: Any) -> List[str]:
    """The user code a run's config (a TrainConfig) names, as ``"reward.funcs SPEC"`` /
    ``"task.reward_fn SPEC"`` (a file with its absolute path): what evaluating it would import
    and run (``tokencredit eval --run`` asks for ``--trust-remote-code`` first)."""
    named = [("reward.funcs", s) for s in (cfg.reward.funcs or ()) if s not in BUILTINS]
    if cfg.task.reward_fn is not None:
        named.append(("task.reward_fn", cfg.task.reward_fn))
    out = []
    for field_name, spec in named:
        module = str(spec).rpartition(":")[0]
        where = os.path.abspath(module) if module.endswith(".py") else None
        out.append(f"{field_name} {spec}" + (f" ({where})" if where and where != module else ""))
    return out


def runner_for(cfg: Any, task: Any) -> RewardRunner:
    """The reward functions of a run (``cfg``: a TrainConfig, ``task``: its Task), checked and
    imported here, before any model loads: ``reward.funcs`` with ``reward.weights``, else the
    task's own reward (``task.reward_fn`` or its built-in grader), per completion."""
    rc = cfg.reward
    if rc.funcs:
        builtins = [s for s in rc.funcs if s in BUILTINS]
        if builtins and task.answer_column is None:
            raise RewardFnError(
                f"reward.funcs: the built-in {builtins[0]!r} grades against a reference answer, and the data has "
                f"none (set data.answer_column to the column that holds it)"
            )
        worker = _Worker()  # the run's: the functions are imported there, and stay loaded
        funcs = load_reward_funcs(rc.funcs, rc.weights, answer_column=answer_key(task.answer_column) or "answer", worker=worker)
        return RewardRunner(funcs, timeout_s=cfg.task.reward_timeout_s, max_failing_steps=rc.max_failing_steps,
                            worker=worker)
    else:
        if not getattr(task, "has_default_reward", True):
            raise RewardFnError(
                "reward.funcs: expected reward functions (--reward.funcs module:function ...): the data has no "
                "answer column for the built-in math reward (answer, solution, ground_truth or reward_model.ground_truth; "
                "data.answer_column names another)"
            )
        funcs = [per_sample_func(task.scorer, task.reward_range)]
    return RewardRunner(funcs, timeout_s=cfg.task.reward_timeout_s, max_failing_steps=rc.max_failing_steps)
