"""The own trainer's evaluation and what it writes under ``<run>/eval``.

* :func:`evaluate_split`: greedy accuracy (the share of rows whose greedy completion is correct:
  the first reward function gives it at least :data:`CORRECT_AT`), the mean weighted reward of
  the greedy completions and mean@k on the eval split, with the rewards' failure counts; the
  greedy completions as rows.
* :func:`write_samples`: those rows as ``eval/samples_step_XXXXXXXX.jsonl``.
* :func:`rollouts_record`: the last training batch with every signal, its credit and the credit
  spec's settings and state, as ``eval/rollouts_step_XXXXXXXX.pt`` holds it (read by
  ``tokencredit inspect`` and ``fidelity``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

__all__ = ["CORRECT_AT", "evaluate_split", "rollouts_record", "write_samples"]

#: a completion is correct (``eval/greedy_acc``, ``eval/mean@k``) when the first reward function
#: (the accuracy one: order it first, as TRL's examples do) gives it at least this much: 1.0 of a
#: 0/1 grader, of verl's -1/1 one; a partial credit below it is not an accuracy
CORRECT_AT = 1.0


def _correct(sc, i: int) -> float:
    v = sc.values[0][i] if sc.values else float("nan")
    return 1.0 if v >= CORRECT_AT else 0.0  # NaN (None, failed) is not correct


def evaluate_split(examples, *, generate: Callable, reward_scores: Callable, k: int, temperature: float,
                   seed: Callable[[int], int], chunk: int, n_funcs: int) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
    """The eval metrics and greedy rows of ``examples``, ``chunk`` prompts per generate call:
    ``eval/greedy_acc`` (the share of rows whose greedy completion is correct, :data:`CORRECT_AT`),
    ``eval/reward`` (the mean weighted reward of the greedy completions) and ``eval/mean@k`` (the
    share of correct completions among k samples a row).

    ``generate(examples, num_samples=, temperature=, seed=None)`` samples; ``reward_scores(rb,
    examples)`` scores (the guarded reward calls of training); ``seed(s)`` is the private seed of
    the mean@k samples of the chunk starting at ``s`` (evaluating never moves the training RNG).
    A failed reward value is left out (0 when it was the only one) and counted in
    ``eval/failed_error`` / ``eval/failed_timeout``; with several reward functions
    (``n_funcs``), each one's ``eval/rewards/NAME/mean`` and ``/std`` too."""
    from ..data.reward_metrics import reward_metrics

    greedy, greedy_correct, meank, samples = [], [], [], []
    failed = {"error": 0, "timeout": 0}
    greedy_scores, greedy_groups = [], []

    def score(rb, part):
        sc = reward_scores(rb, part)
        for kind in failed:
            failed[kind] += sc.failed[kind]
        return sc

    for s in range(0, len(examples), chunk):
        part = examples[s : s + chunk]
        rb = generate(part, num_samples=1, temperature=0.0)
        sc = score(rb, part)
        greedy_scores.append(sc)
        greedy_groups.append(rb.prompt_index.tolist())
        for i, text in enumerate(rb.texts):
            greedy.append(sc.total[i])
            greedy_correct.append(_correct(sc, i))
            samples.append({"id": part[i].id, "question": part[i].question, "answer": part[i].answer, "greedy": text, "reward": greedy[-1]})
        if k > 0:
            rbk = generate(part, num_samples=k, temperature=temperature, seed=seed(s))
            sck = score(rbk, part)
            meank.extend(_correct(sck, i) for i in range(len(rbk.texts)))
    metrics = {"eval/greedy_acc": float(np.mean(greedy_correct)), "eval/reward": float(np.mean(greedy))}
    if n_funcs > 1:
        metrics.update({name: v for name, v in reward_metrics(greedy_scores, greedy_groups, prefix="eval/").items()
                        if name.startswith("eval/rewards/")})
    if meank:
        metrics[f"eval/mean@{k}"] = float(np.mean(meank))
    metrics["eval/failed_error"] = float(failed["error"])
    metrics["eval/failed_timeout"] = float(failed["timeout"])
    return metrics, samples


def write_samples(path: Path, samples: List[Dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in samples:
            f.write(json.dumps(row) + "\n")


def rollouts_record(credit, last_batch: Dict[str, Any], tokenizer, step: int) -> Dict[str, Any]:
    """The saved rollouts of the last training batch (``last_batch``: the step's ``StepBatch``,
    ``CreditBatch``, credit output and the credit spec's state after it) of ``credit`` (a
    ``CreditPipeline``), as the file's dict (:class:`tokencredit.train.records.RolloutsRecord`)."""
    from .records import RolloutsRecord

    batch = last_batch["batch"]
    return RolloutsRecord.build(
        credit, last_batch["credit_batch"], last_batch["credit"], response_ids=batch.response_ids, tokenizer=tokenizer,
        questions=[batch.examples[int(i)].question for i in batch.prompt_index], step=step, texts=batch.texts,
        credit_state=last_batch["credit_state"],
    ).to_dict()
