"""TokenCreditGRPOTrainer's multimodal path gives only what TRL's helper computes (log-probs and
entropy through ``_get_per_token_logps_and_entropies``): a spec needing any other policy-pass
signal is refused by name, read from the plan rather than a list of method names."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from tokencredit import CreditPipeline  # noqa: E402
from tokencredit.integrations.trl import TokenCreditGRPOTrainer  # noqa: E402
from tokencredit.credit.plan import plan_signals  # noqa: E402


def _bare(spec: str, calls: list) -> TokenCreditGRPOTrainer:
    tr = object.__new__(TokenCreditGRPOTrainer)  # only the attributes the multimodal pass reads
    tr.credit = CreditPipeline(spec)
    tr._plan = plan_signals(tr.credit, lora=False)

    def helper(model, ids, att, T, batch_size=None, compute_entropy=False, **mm):
        calls.append(mm)
        return torch.zeros(ids.shape[0], T), (torch.ones(ids.shape[0], T) if compute_entropy else None), None

    tr._get_per_token_logps_and_entropies = helper
    tr.model = None
    return tr


@pytest.mark.parametrize("spec, missing", [("otb", "sum_pi_squared"), ("grpo+acpo", "mode_prob")])
def test_a_policy_signal_trl_cannot_give_is_refused_by_name(spec, missing):
    calls: list = []
    tr = _bare(spec, calls)
    assert missing in tr._plan.policy
    with pytest.raises(NotImplementedError, match=rf"signals \[[^]]*'{missing}'"):
        tr._multimodal_signals({}, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), 3, 2, {"pixel_values": None})
    assert calls == []  # refused before any forward


def test_log_probs_and_entropy_come_from_trls_helper():
    calls: list = []
    tr = _bare("grpo+stare", calls)
    got = tr._multimodal_signals({}, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), 3, 2, {"pixel_values": 1})
    assert calls == [{"pixel_values": 1}]
    assert set(got) == {"logprobs", "entropy"} and got["entropy"].shape == (2, 3)
