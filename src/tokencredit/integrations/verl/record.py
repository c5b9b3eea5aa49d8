"""The step batch of a verl run as ``tokencredit inspect`` replays it: a
:class:`tokencredit.train.records.RolloutsRecord` (the own trainer's ``eval/rollouts_step_*.pt``), built on the driver from the
fields verl's v1 trainer keeps in TransferQueue. Pure: the trainer mode reads the fields
(:meth:`.trainer.TokenCreditPPOTrainerSync._tc_rollouts_record`) and saves the record with every
checkpoint under ``trainer.default_local_dir/eval/``.

What is in it: the driver's signals (``rewards`` = verl's ``rm_scores`` summed over tokens,
``group_ids`` from the prompt uids, ``logprobs`` = the old-log-prob pass, ``entropy`` when the step
computed it), the advantages verl's estimator gave (calibrators run per micro-batch in the actor's
loss; ``inspect`` replays them on these signals), tokens, texts, the prompts' last user message,
and the spec's configs and state.
"""

from __future__ import annotations

from typing import Any

import torch

from ...train.records import RolloutsRecord
from ...credit.registry import CreditOutput

__all__ = ["RECORD_FIELDS", "padded", "rollouts_record"]

#: the TransferQueue fields the record reads (``entropy`` only when the step computed it)
RECORD_FIELDS = ["responses", "response_mask", "advantages", "rm_scores", "old_log_probs", "entropy", "uid", "raw_prompt"]


def padded(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """A nested (jagged) TensorDict field as a right-padded tensor; a padded one as it is."""
    return x.to_padded_tensor(value) if getattr(x, "is_nested", False) else x


def _question(messages: Any) -> str:
    users = [dict(m) for m in list(messages) if dict(m).get("role") == "user"]
    return str(users[-1]["content"]) if users else str(messages)


def rollouts_record(data, tokenizer, credit, step: int) -> RolloutsRecord:
    """``data``: the TensorDict of :data:`RECORD_FIELDS` (rows of the step batch without verl's
    padding samples); ``credit``: the driver's ``CreditPipeline`` (its configs and state)."""
    present = set(data.keys())
    missing = sorted({"responses", "response_mask", "advantages", "rm_scores", "old_log_probs", "uid", "raw_prompt"} - present)
    if missing:
        raise KeyError(f"rollouts record: verl's batch has no field(s) {missing} (it has {sorted(present)})")
    uids = [str(u) for u in data["uid"]]
    order = {u: j for j, u in enumerate(dict.fromkeys(uids))}
    mask = padded(data["response_mask"]).bool()
    signals = {
        "response_mask": mask.long(),
        "rewards": padded(data["rm_scores"]).float().sum(-1),
        "group_ids": torch.tensor([order[u] for u in uids]),
        "logprobs": padded(data["old_log_probs"]).float() * mask,
    }
    if "entropy" in present:
        signals["entropy"] = padded(data["entropy"]).float() * mask
    # verl's estimator's advantages; the calibrators run per micro-batch in the actor's loss
    out = CreditOutput(advantages=padded(data["advantages"]).float() * mask)
    return RolloutsRecord.build(credit, signals, out, response_ids=padded(data["responses"]).long(), tokenizer=tokenizer,
                                questions=[_question(m) for m in data["raw_prompt"]], step=step)
