"""A step's rollouts: samples, their rewards, DAPO's dynamic sampling, and the rollout's metrics.

* :func:`reward_scores`: the reward functions on a rollout batch, with TRL's arguments
  (``tokencredit.data.rewards``: each call in a killable worker, on its own copy of the rows).
* :func:`score`: those rewards as tensors, with DAPO's soft overlong punishment when asked.
* :func:`collect`: K samples for each of a step's prompts and their rewards; with DAPO's dynamic
  sampling, groups whose rewards are all equal are dropped and more prompts sampled (bounded)
  until the step has its number of groups, and no more.
* :class:`StepBatch`: the kept groups of a step's rollout rounds in one layout: the trainer's batch.
* :func:`rollout_metrics` / :func:`batch_metrics`: the rollout's metrics (TRL's names for the
  reward and completion ones) and the kept batch's.

Used by the own trainer (``trainer.Trainer._collect``), which passes its data order, its
generation and its scoring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["StepBatch", "batch_metrics", "collect", "reward_scores", "rollout_metrics", "score"]


def reward_scores(runner, rb, examples, state: Dict[str, Any]):
    """The reward functions of ``runner`` (a ``rewards`` runner) on the rollout batch ``rb`` of
    ``examples``; ``state`` is TRL's trainer state (``global_step``, ``max_steps``)."""
    exs = [examples[int(i)] for i in rb.prompt_index]
    conv = bool(exs) and exs[0].conversational
    completions = [[{"role": "assistant", "content": t}] for t in rb.texts] if conv else list(rb.texts)
    ids = [row[m.bool()].tolist() for row, m in zip(rb.response_ids.cpu(), rb.response_mask.cpu())]
    prompts = [list(e.messages) if e.conversational else e.prompt_value() for e in exs]
    return runner.score(completions, ids, exs, prompts, state=state)


def score(scores, rb, dapo, max_new_tokens: int) -> Dict[str, Any]:
    """``scores`` (of :func:`reward_scores`) as the step uses them: ``rewards`` (with DAPO's
    overlong shaping when ``dapo.overlong_shaping``), ``correct`` (the unshaped rewards, for
    accuracy and dynamic sampling), ``failed`` counts and the ``scores`` themselves."""
    rewards = torch.tensor(scores.total, dtype=torch.float32)
    correct = rewards.clone()
    if dapo.overlong_shaping:
        from .dapo import overlong_penalty

        lengths = rb.response_mask.sum(1)
        cache = dapo.overlong_cache if dapo.overlong_cache is not None else max(1, max_new_tokens // 5)
        rewards = rewards + overlong_penalty(lengths, max_new_tokens, cache)
    return {"rewards": rewards, "correct": correct, "failed": scores.failed, "scores": scores}


def collect(next_examples: Callable, generate: Callable, score_batch: Callable, rollout, dapo) -> Dict[str, Any]:
    """Rollouts for one step: ``next_examples(n)`` prompts, ``generate(examples, num_samples=,
    temperature=)``, ``score_batch(rb, examples)`` (:func:`score`'s dict); with
    ``dapo.dynamic_sampling``, regenerate (at most ``dapo.max_rounds`` rounds) to fill the step's
    ``rollout.prompts_per_step`` groups. Returns the rounds' parts (each with its ``keep`` mask),
    the number of rounds, the failure counts and every round's unshaped rewards."""
    r, d = rollout, dapo
    kept: List[Dict[str, Any]] = []
    n_groups, rounds, failed = 0, 0, {"error": 0, "timeout": 0}
    all_rewards = []
    while True:
        rounds += 1
        examples = next_examples(r.prompts_per_step)
        rb = generate(examples, num_samples=r.samples_per_prompt, temperature=r.temperature)
        sc = score_batch(rb, examples)
        all_rewards.append(sc["correct"])
        for k in failed:
            failed[k] += sc["failed"][k]
        keep = torch.ones(len(rb.texts), dtype=torch.bool)
        if d.dynamic_sampling:
            from .dapo import dynamic_sampling_filter

            # on accuracy, not the overlong-shaped reward (DAPO; verl's filter_groups.metric=acc)
            keep = dynamic_sampling_filter(sc["correct"], rb.prompt_index)
            # DAPO fills the batch to its size and no further: groups past prompts_per_step
            # are dropped, so every step trains on the same number of groups as the others
            for g in rb.prompt_index[keep].unique().tolist():
                if n_groups >= r.prompts_per_step:
                    keep &= rb.prompt_index != g
                else:
                    n_groups += 1
        else:
            n_groups += len(examples)
        kept.append({"rb": rb, "examples": examples, "keep": keep, **sc})
        if not d.dynamic_sampling or n_groups >= r.prompts_per_step or rounds >= d.max_rounds:
            break
    return {"parts": kept, "rounds": rounds, "failed": failed, "all_correct": torch.cat(all_rewards)}


def rollout_metrics(col: Dict[str, Any], step: int) -> Dict[str, float]:
    """The metrics of :func:`collect`'s result at (1-based) ``step``, with TRL's names for the
    rewards and completions (rewards/NAME/mean|std, reward (the mean unshaped reward of every
    round), reward_std, frac_reward_zero_std, completions/*), each once."""
    from ..data.reward_metrics import completion_metrics, reward_metrics

    parts = col["parts"]
    metrics: Dict[str, float] = {
        "step": float(step),
        "reward/failed_error": float(col["failed"]["error"]),
        "reward/failed_timeout": float(col["failed"]["timeout"]),
        "rollout/rounds": float(col["rounds"]),
    }
    metrics.update(reward_metrics([p["scores"] for p in parts], [p["rb"].prompt_index.tolist() for p in parts]))
    metrics.update(completion_metrics(torch.cat([p["rb"].response_mask.sum(1) for p in parts]).tolist(),
                                      torch.cat([p["rb"].truncated for p in parts]).tolist()))
    return metrics


def batch_metrics(batch, samples_per_prompt: int) -> Dict[str, float]:
    """The kept batch's (a ``StepBatch``) shaped reward and group count (its lengths and
    truncation are the rollout's ``completions/*``: each metric is logged once)."""
    return {
        "reward/shaped_mean": float(batch.rewards.mean()),
        "groups/count": float(len(batch) // samples_per_prompt),
    }


@dataclass
class StepBatch:
    """One training step's batch: the kept groups of one or more rollout rounds (DAPO's dynamic
    sampling may take several), re-padded into one layout (left-padded prompts, right-padded
    responses, as :class:`~tokencredit.engine.rollout.RolloutBatch`). ``prompt_index`` indexes ``examples``; rows of one
    prompt are contiguous. The oracle pass's own input (oracle-prompted prompts + the same
    responses) is attached by the trainer when its plan has one."""

    input_ids: torch.Tensor  # [N, P + T]
    attention_mask: torch.Tensor  # [N, P + T]
    prompt_len: int  # P
    response_ids: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, T] long
    behaviour_logprobs: torch.Tensor  # [N, T]
    rewards: torch.Tensor  # [N] (shaped: DAPO's overlong penalty included)
    truncated: torch.Tensor  # [N] bool
    prompt_index: torch.Tensor  # [N] long, into examples
    texts: List[str]
    examples: List[Any]
    oracle_input_ids: Optional[torch.Tensor] = None
    oracle_attention_mask: Optional[torch.Tensor] = None
    oracle_prompt_len: Optional[int] = None

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    def to(self, device) -> "StepBatch":
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in self.__dict__.items()}
        return StepBatch(**moved)

    @classmethod
    def assemble(cls, parts: Sequence[Dict[str, Any]], pad_id: int) -> Optional["StepBatch"]:
        """The kept rows of rollout rounds ``parts`` (each ``{"rb": RolloutBatch, "examples": [...],
        "keep": [N] bool, "rewards": [N]}``) as one batch; None when no row is kept."""
        rows, examples = [], []
        for part in parts:
            rb, keep = part["rb"], part["keep"]
            base = len(examples)
            examples.extend(part["examples"])
            rows += [(part, i, base + int(rb.prompt_index[i])) for i in range(len(rb.texts)) if keep[i]]
        if not rows:
            return None
        P = max(int(p["rb"].prompt_ids.shape[1]) for p, _, _ in rows)
        T = max(1, max(int(p["rb"].response_mask[i].sum()) for p, i, _ in rows))
        N = len(rows)
        prompt_ids = torch.full((N, P), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((N, P), dtype=torch.long)
        resp = torch.full((N, T), pad_id, dtype=torch.long)
        rmask = torch.zeros((N, T), dtype=torch.long)
        blp = torch.zeros((N, T))
        rewards = torch.zeros(N)
        truncated = torch.zeros(N, dtype=torch.bool)
        pidx = torch.zeros(N, dtype=torch.long)
        texts = []
        for j, (part, i, gi) in enumerate(rows):
            rb = part["rb"]
            p_ids, p_m = rb.prompt_ids[i], rb.prompt_mask[i]
            prompt_ids[j, P - p_ids.shape[0]:] = p_ids
            prompt_mask[j, P - p_m.shape[0]:] = p_m
            L = int(rb.response_mask[i].sum())
            resp[j, :L] = rb.response_ids[i, :L]
            rmask[j, :L] = 1
            blp[j, :L] = rb.behaviour_logprobs[i, :L]
            rewards[j] = part["rewards"][i]
            truncated[j] = bool(rb.truncated[i])
            pidx[j] = gi
            texts.append(rb.texts[i])
        return cls(
            input_ids=torch.cat([prompt_ids, resp], 1), attention_mask=torch.cat([prompt_mask, rmask], 1),
            prompt_len=P, response_ids=resp, response_mask=rmask, behaviour_logprobs=blp, rewards=rewards,
            truncated=truncated, prompt_index=pidx, texts=texts, examples=examples,
        )
