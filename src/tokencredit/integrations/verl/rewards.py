"""TRL-style reward functions in verl: a ``custom_reward_function`` that runs them.

verl's reward managers call ``compute_score(data_source=, solution_str=, ground_truth=,
extra_info=)`` once per response, with ``custom_reward_function.reward_kwargs`` merged in. This
file's :func:`compute_score` runs the functions named in ``reward_kwargs.funcs`` (the same
``module:function`` / ``file.py:function`` / built-in names as ``tokencredit train
--reward.funcs``) on that one response, with TRL's arguments, and returns verl's dict form
(``score``: the weighted sum; one entry per function, logged by verl as reward extra info)::

    reward.custom_reward_function.path=$(python -c "import tokencredit.integrations.verl.rewards as m; print(m.__file__)")
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.funcs='[my_rewards:correct,my_rewards:brevity]'
    +reward.custom_reward_function.reward_kwargs.weights='[1.0,0.1]'
    +reward.custom_reward_function.reward_kwargs.answer_column=solution   # optional: the ground truth under this name too

What a function receives is what ``tokencredit train`` and ``TokenCreditGRPOTrainer`` give it on
the same verl-layout rows (:func:`tokencredit.data.rewards.reward_columns`, one reading in all three):
``ground_truth``, ``data_source``, ``extra_info`` (the row's mapping) and each of its keys as a
column, and the ground truth under ``answer_column`` too when one is named (``solution``: a
function written for such a column; the built-ins ``math`` and ``numeric`` read it, default
``ground_truth``). ``completions=[[{"role": "assistant", "content": solution_str}]]``: verl's
prompts are conversations, and TRL's contract gives a conversation's completion as a message
(``reward_kwargs.conversational=false``: the plain string). What verl's reward manager adds to
``extra_info`` is left out where empty (``num_turns`` None, ``rollout_reward_scores`` {}), so that
a function sees the row's own ``extra_info``. ``prompts=[None]`` and ``completion_ids=[None]``:
verl does not pass the prompt or the response's token ids to ``compute_score`` (a function that
needs them fails loudly, it is not given a wrong value); ``trainer_state=None``. A function
returning None leaves itself out of the sum, as in TRL. verl bounds the call itself
(``reward.reward_manager.compute_score_timeout``); an exception propagates to verl, as any
``compute_score``'s does.

verl loads this file by its path (``load_extern_object``), so it imports only ``tokencredit.data.rewards``
(absolute imports), never the verl plugin package.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tokencredit.data.rewards import (
    RewardFnError,
    checked_values,
    load_reward_funcs,
    resolve_ref,
    reward_columns,
)

__all__ = ["compute_score"]

_CACHE: Dict[Tuple, List[Tuple[str, Any, float]]] = {}


def _functions(funcs: Sequence[str], weights: Optional[Sequence[float]], answer_column: str):
    key = (tuple(funcs), tuple(weights or ()), answer_column)
    if key not in _CACHE:
        if isinstance(funcs, str) or not funcs:
            raise RewardFnError(f"reward_kwargs.funcs: expected a list of reward functions ('module:function' or a built-in), got {funcs!r}")
        loaded = load_reward_funcs(list(funcs), list(weights or ()), answer_column=answer_column, in_process=True)
        _CACHE[key] = [(f.name, resolve_ref(f.ref), f.weight) for f in loaded]
    return _CACHE[key]


def compute_score(data_source: Any = None, solution_str: str = "", ground_truth: Any = None, extra_info: Optional[dict] = None,
                  *, funcs: Sequence[str] = (), weights: Optional[Sequence[float]] = None, answer_column: str = "ground_truth",
                  conversational: bool = True, **_: Any) -> Dict[str, float]:
    """verl's ``compute_score`` for one response: ``{"score": weighted sum, NAME: value, ...}``
    (a value a function left out is NaN and not in the sum)."""
    row = reward_columns({"data_source": data_source, "reward_model": {"ground_truth": ground_truth},
                          "extra_info": dict(extra_info or {})})
    row[answer_column] = ground_truth
    completion: Any = [{"role": "assistant", "content": solution_str}] if conversational else solution_str
    out: Dict[str, float] = {}
    total = 0.0
    for name, fn, weight in _functions(funcs, weights, answer_column):
        kwargs = {k: [v] for k, v in row.items()}
        kwargs.update(prompts=[None], completions=[completion], completion_ids=[None], trainer_state=None,
                      log_metric=lambda *a, **k: None, log_extra=lambda *a, **k: None)
        (value,) = checked_values(fn(**kwargs), 1)
        if isinstance(value, tuple):  # not a finite real number
            raise ValueError(f"reward {name}: {value[1]}")
        out[name] = math.nan if value is None else float(value)
        if value is not None:
            total += weight * float(value)
    return {"score": total, **out}
