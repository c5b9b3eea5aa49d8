"""Graders: the final-answer parser, numeric equality, math-verify, and the reward check.

Per-completion graders ``(completion, example) -> float`` used by the built-in tasks:

    numeric_reward   1.0 when :func:`extract_final_answer` equals the reference numerically; the
                     procedural tasks' grader (math-verify takes the last expression of a
                     completion, and the model restates expressions after its answer:
                     ``tests/test_tasks.py::test_math_verify_misreads_a_restated_expression``)
    math_reward      math-verify's ``verify(parse(gold), parse(completion))``: gsm8k, math, own data

No tokencredit imports: the reward worker process (``tokencredit.data.rewards``) and the tasks use it.
"""

from __future__ import annotations

import math
import numbers
import re
import signal
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import RewardValueError  # noqa: F401 (defined in errors; importable here too)

__all__ = [
    "BUILTINS",
    "RewardValueError",
    "TRL_EXTRA_KWARGS",
    "answers_match",
    "check_reward",
    "MAX_ABS_REWARD",
    "completion_text",
    "extract_final_answer",
    "math_reward",
    "math_verify_equal",
    "numeric_reward",
    "gold_answer",
    "math_accuracy",
    "numeric_accuracy",
    "reference_answer",
]

# ---------------------------------------------------------------------------------------------
# Answer parsing
# ---------------------------------------------------------------------------------------------

# A number: optional sign (not after a word character or ")", so "5-3" is not "5" and "-3"),
# comma-grouped thousands or plain digits, optional decimals, optionally a fraction "/ integer"
# ("3/4" is one number, never 3); ordinals ("2nd") are not numbers, nor is anything of a
# slash-separated run that is no fraction ("1/2/2020": no number at all).
_NUM = re.compile(
    r"(?<![\w)\]./])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?![.,]\d))?(?![\d/])(?!\s*/\s*\d)"
    r"(?!(?:st|nd|rd|th)\b)"
)
_LATEX_FRAC = re.compile(r"^\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}$")
_OPS = r"[+\-*/×÷^x]"
_FOLLOWED_BY_OPERATOR = re.compile(rf"\s*(?:[=?]|{_OPS}\s*[-(]?\d)")
_PRECEDED_BY_OPERATOR = re.compile(rf"(?:\d|\))\s*{_OPS}\s*$")
_ANSWER_MARKER = re.compile(r"\banswer\b(?:\s+is\b|\s*[:=])", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)|\n")


def _canon_number(s: str) -> Optional[str]:
    """'1,234' -> '1234', '68.0' -> '68', '+5' -> '5', '-0' -> '0'; None if not a number."""
    s = s.strip().replace(",", "").lstrip("+")
    if s.endswith("."):
        s = s[:-1]
    try:
        d = Decimal(s)
    except (InvalidOperation, ValueError):
        return None
    if not d.is_finite():
        return None
    if d == 0:
        return "0"
    return format(d.normalize(), "f")


def _as_fraction(s: Optional[str]) -> Optional[Fraction]:
    """An answer string as an exact number: '1,234', '68.0', '3/4', '-6 / 8', '\\frac{3}{4}'
    (also ``\\dfrac``, ``\\tfrac``); None when it is none (a zero denominator included)."""
    if s is None:
        return None
    s = _strip_latex(str(s))
    m = _LATEX_FRAC.match(s)
    num, den = (m.group(1), m.group(2)) if m else (s.split("/", 1) if s.count("/") == 1 else (s, "1"))
    a, b = _canon_number(num), _canon_number(den)
    if a is None or b is None or Decimal(b) == 0:
        return None
    return Fraction(Decimal(a)) / Fraction(Decimal(b))


def _canon_answer(s: str) -> Optional[str]:
    """A number as :func:`_canon_number` writes it; a fraction in lowest terms ('6/8' -> '3/4',
    '4/2' -> '2'); None if not a number."""
    if "/" not in s:
        return _canon_number(s)
    f = _as_fraction(s)
    if f is None:
        return None
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last complete \\boxed{...} / \\fbox{...} (nested braces allowed)."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        # unbalanced (truncated completion): try an earlier one
    return None


def _strip_latex(s: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|,|;|!|\$|%)", "", s)
    return s.replace("$", "").replace("%", "").strip()


def _answer_in(segment: str) -> Optional[str]:
    """The number a marker points at: the first one after the segment's last '=' (if any)."""
    if "=" in segment:
        segment = segment.rsplit("=", 1)[1]
    m = _NUM.search(segment)
    return _canon_answer(m.group()) if m else None


def _first_sentence(text: str) -> str:
    m = _SENTENCE_END.search(text)
    return text[: m.start()] if m else text


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer in a completion, as a canonical number string when it is a number.

    Order: last ``\\boxed{X}``; last ``#### X``; last "answer is X" / "answer: X" (within its
    sentence; "answer is 5 + 3 = 8" gives 8); else the last number that is not an operand of a
    restated expression. A fraction ``3/4`` is one number (in lowest terms, never "3"); a
    slash-separated run that is no fraction (a date) is none. A boxed non-numeric answer
    (``\\frac{1}{2}``) is returned as written (:func:`answers_match` reads ``\\frac``). None when
    there is no answer.
    """
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        content = _strip_latex(boxed)
        num = _canon_answer(content)
        if num is not None:
            return num
        after_eq = content.rsplit("=", 1)[-1]
        nums = _NUM.findall(after_eq)
        if len(nums) == 1 and not re.search(r"\\|/", after_eq):
            return _canon_answer(nums[0])
        return content or None
    hashes = text.rfind("####")
    if hashes >= 0:
        num = _answer_in(_first_sentence(text[hashes + 4 :].lstrip()))
        if num is not None:
            return num
    markers = list(_ANSWER_MARKER.finditer(text))
    for m in reversed(markers):
        num = _answer_in(_first_sentence(text[m.end() :].lstrip(" \t*:$")))
        if num is not None:
            return num
    for m in reversed(list(_NUM.finditer(text))):
        if _FOLLOWED_BY_OPERATOR.match(text, m.end()) or _PRECEDED_BY_OPERATOR.search(text[: m.start()]):
            continue
        return _canon_answer(m.group())
    return None


def answers_match(pred: Optional[str], ref: str) -> bool:
    """Exact numeric equality of two answer strings ('68.0' == '68', '1,234' == '1234', '3/4' ==
    '0.75' == '\\frac{3}{4}'); False when either is no number."""
    a, b = _as_fraction(pred), _as_fraction(ref)
    return a is not None and b is not None and a == b


def numeric_reward(completion: str, example: Any) -> float:
    """1.0 if the completion's final answer equals ``example.answer`` numerically, else 0.0."""
    return 1.0 if answers_match(extract_final_answer(completion), example.answer) else 0.0


def math_verify_equal(gold: str, completion: str) -> bool:
    """math-verify's ``verify(parse(gold), parse(completion))``, the gold answer read as
    ``\\boxed{gold}`` (so ``72``, ``\\frac{1}{2}`` and ``x^2`` are all answers, not text).

    math-verify bounds its own work with ``signal.alarm``, which works only in a main thread; in
    another thread its timeouts are off and the caller's timeout bounds the call (the reward
    worker runs it in its main thread)."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
    limit = 5 if main else None  # math-verify's own default, in seconds
    gold_parsed = parse("\\boxed{" + str(gold) + "}", parsing_timeout=limit)
    if not gold_parsed:
        return False
    pred = parse(completion, parsing_timeout=limit)
    if not pred:
        return False
    return bool(verify(gold_parsed, pred, timeout_seconds=limit))


def math_reward(completion: str, example: Any) -> float:
    """1.0 when math-verify finds the completion's answer equal to ``example.answer``, else 0.0
    (the grader of gsm8k, math and own data)."""
    return 1.0 if math_verify_equal(example.answer, completion) else 0.0


def reference_answer(row: Dict[str, Any]) -> Optional[str]:
    """GSM8K '... #### 72' -> '72'; MATH solution -> its last \\boxed{}; else the answer as is."""
    ans = row.get("answer")
    if isinstance(ans, (int, float)) and not isinstance(ans, bool):
        ans = str(ans)
    if isinstance(ans, str) and ans.strip():
        if "####" in ans:
            tail = ans.rsplit("####", 1)[1].strip()
            return _canon_number(tail) or tail or None
        return _canon_number(ans) or ans.strip()
    sol = row.get("solution")
    if isinstance(sol, str):
        boxed = _last_boxed(sol)
        if boxed is not None and boxed.strip():
            return _canon_number(_strip_latex(boxed)) or boxed.strip()
    return None


#: the largest reward magnitude a reward function may return: rewards become a float32 tensor
#: (max ~3.4e38) whose group statistics square them (a group std of 1e15-sized rewards stays
#: finite for groups of up to ~1e8); 1e308 is a finite Python float but inf there
MAX_ABS_REWARD = 1e15


def check_reward(value: Any, reward_range: Optional[Tuple[float, float]] = None) -> float:
    """``value`` as a float if it is a finite real number (a bool, a numpy scalar or a one-element
    tensor counts; a string such as ``"1.0"`` does not) of magnitude at most
    :data:`MAX_ABS_REWARD`, within ``reward_range`` (inclusive), else
    :class:`RewardValueError`. Training and evaluation both score through this check
    (``Task.reward`` inside :func:`score_safely`)."""
    if not (isinstance(value, numbers.Real) or hasattr(type(value), "__float__")) or isinstance(value, (str, bytes, complex)):
        raise RewardValueError(f"reward: expected a real number, got {type(value).__name__} {value!r:.60}")
    try:
        r = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise RewardValueError(f"reward: expected a single real number, got {type(value).__name__} ({e})") from None
    if not math.isfinite(r):
        raise RewardValueError(f"reward: expected a finite number, got {r}")
    if abs(r) > MAX_ABS_REWARD:
        raise RewardValueError(f"reward: expected a number of magnitude at most {MAX_ABS_REWARD:g} "
                               f"(training statistics are float32), got {r:g}")
    if reward_range is not None and not reward_range[0] <= r <= reward_range[1]:
        raise RewardValueError(f"reward: expected a number in [{reward_range[0]}, {reward_range[1]}], got {r}")
    return r


def gold_answer(value: Any) -> Optional[str]:
    """A reference answer as the graders take it: GSM8K's '... #### 72' -> '72', a MATH solution
    -> its last \\boxed{}; a number or a plain string as it is; the first of several; None when
    there is none."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return _canon_number(str(value)) or str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    return reference_answer({"solution": value} if "\\boxed" in value else {"answer": value})


# ---------------------------------------------------------------------------------------------
# Built-in reward functions (TRL's contract: tokencredit.data.rewards runs them, --reward.funcs math numeric)
# ---------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the content of a conversational completion's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def math_accuracy(completions, answer_column: str = "answer", **kwargs) -> List[Optional[float]]:
    """Built-in ``math``: 1.0 when math-verify finds the completion's answer equal to the row's
    reference (the column ``answer_column``), else 0.0; None for a row without a reference."""
    golds = kwargs.get(answer_column)
    if golds is None:
        raise KeyError(f"built-in reward 'math' reads the column {answer_column!r}, which the rows do not have "
                       f"(columns: {sorted(k for k in kwargs if k not in TRL_EXTRA_KWARGS)})")
    out: List[Optional[float]] = []
    for c, g in zip(completions, golds):
        gold = gold_answer(g)
        out.append(None if gold is None else (1.0 if math_verify_equal(gold, completion_text(c)) else 0.0))
    return out


def numeric_accuracy(completions, answer_column: str = "answer", **kwargs) -> List[Optional[float]]:
    """Built-in ``numeric``: 1.0 when the completion's final answer
    (:func:`~tokencredit.data.grading.extract_final_answer`) equals the reference numerically."""
    golds = kwargs.get(answer_column)
    if golds is None:
        raise KeyError(f"built-in reward 'numeric' reads the column {answer_column!r}, which the rows do not have "
                       f"(columns: {sorted(k for k in kwargs if k not in TRL_EXTRA_KWARGS)})")
    out: List[Optional[float]] = []
    for c, g in zip(completions, golds):
        gold = gold_answer(g)
        out.append(None if gold is None else (1.0 if answers_match(extract_final_answer(completion_text(c)), gold) else 0.0))
    return out


#: built-in reward names -> TRL-contract functions (the answer column is bound when loaded)
BUILTINS: Dict[str, Callable[..., List[Optional[float]]]] = {"math": math_accuracy, "numeric": numeric_accuracy}

#: keyword arguments the caller adds to the row's columns (TRL's names)
TRL_EXTRA_KWARGS = ("trainer_state", "log_metric", "log_extra")
