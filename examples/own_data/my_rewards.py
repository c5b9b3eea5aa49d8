"""Reward functions with TRL's contract: the same functions work in `tokencredit train
--reward.funcs my_rewards:correct my_rewards:brevity`, in trl.GRPOTrainer /
TokenCreditGRPOTrainer (reward_funcs=[correct, brevity]) and in verl (through
tokencredit/integrations/verl/rewards.py)."""

import re


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(completions, solution, **kwargs):
    """1.0 when the last number in the completion is the solution, else 0.0."""
    out = []
    for c, s in zip(completions, solution):
        numbers = re.findall(r"-?\d+", _text(c))
        out.append(1.0 if numbers and numbers[-1] == str(s) else 0.0)
    return out


def brevity(completions, completion_ids, **kwargs):
    """A length penalty in [-1, 0]: minus the share of 64 tokens the completion used."""
    return [-min(len(ids), 64) / 64 for ids in completion_ids]
