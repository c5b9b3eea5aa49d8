"""HICRA and SEPA against the retrain project's code (teilomillet/retrain: advantages/credit.py,
advantages/planning.py, training/sepa.py), with references written per response from reading it,
and the planning-token detector on hand cases."""

from __future__ import annotations

import math

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.methods.hicra import DEFAULT_STRATEGIC_GRAMS, HICRAConfig, hicra, planning_mask_of
from tokencredit.methods.sepa import SEPAConfig, SEPAController, sepa
from tokencredit.plan import PlanError, plan_signals

from helpers import make_batch, pad_batch


# ---- the planning-token detector ---------------------------------------------------------


def test_planning_tokens_hand_cases():
    # "wait let me" from token 0 (tokens 0-2), then "let me check" from token 1 (tokens 1-3)
    assert planning_mask_of(["Wait", " let", " me", " check", "."]) == [1, 1, 1, 1, 0]
    # word boundaries: "awaited" does not contain the word "wait"
    assert planning_mask_of(["awaited", " let", " me", " go"]) == [0, 0, 0, 0]
    # sentencepiece / byte-level markers are spaces; case does not matter
    assert planning_mask_of(["\u2581Let", "\u2581me", "\u2581THINK", "\u2581now"]) == [1, 1, 1, 0]
    assert planning_mask_of(["\u0120the", "\u0120key", "\u0120is", "\u0120x"]) == [1, 1, 1, 0]
    # empty fragments (a bare space token) do not break a gram
    assert planning_mask_of(["Let", " ", "me", " ", "verify"]) == [1, 1, 1, 1, 1]
    assert planning_mask_of(["1", " +", " 2", "\n"]) == [0, 0, 0, 0]
    # fragments are joined with spaces, so a word split across tokens is not matched (as in
    # retrain), nor a gram wider than the window of max(5, longest gram in words) fragments
    assert planning_mask_of(["le", "t", " me", " think"]) == [0] * 4
    assert planning_mask_of(["let", " ", " ", " ", " ", " ", "me", " think"]) == [0] * 8
    assert planning_mask_of([], DEFAULT_STRATEGIC_GRAMS) == [] and planning_mask_of(["wait"], ()) == [0]


# ---- references, one response at a time (from retrain/advantages/credit.py) ---------------


def ref_hicra(advs, plan, alpha=0.2):
    return [a + alpha * abs(a) if m else a for a, m in zip(advs, plan)]


def ref_sepa_pool(s, plan, lam):
    lam = max(0.0, min(1.0, lam))
    if lam == 0.0:
        return list(s)
    s = [min(e, 50.0) for e in s]
    ex = [e for e, m in zip(s, plan) if m == 0]
    if not ex:
        return list(s)
    mu = sum(ex) / len(ex)
    return [e if m else lam * mu + (1 - lam) * e for e, m in zip(s, plan)]


def ref_gtpo(a, s, beta=0.1):
    if not s:
        return []
    if beta == 0.0:
        return [a] * len(s)
    s = [min(e, 50.0) for e in s]
    mh = sum(s) / len(s)
    if mh < 1e-7:
        return [a] * len(s)
    return [a * max(0.0, 1.0 + beta * (h / (mh + 1e-8) - 1.0)) for h in s]


def _rows(batch):
    return [batch.mask[b].nonzero().squeeze(1).tolist() for b in range(batch.batch_size)]


@pytest.mark.parametrize("seed", range(4))
def test_hicra_equals_retrain_per_response(seed):
    batch = make_batch(8, 7, 4, seed=seed, lengths=[7, 3, 0, 5, 1, 7, 6, 2], dtype=torch.float64)
    adv = CreditPipeline("grpo")(batch).advantages
    for alpha in (0.2, 0.7):
        out = hicra(batch, adv, HICRAConfig(alpha=alpha)).advantages
        for b, pos in enumerate(_rows(batch)):
            want = ref_hicra(adv[b, pos].tolist(), batch.planning_mask[b, pos].tolist(), alpha)
            assert out[b, pos].tolist() == pytest.approx(want, abs=1e-12)
        assert (out[~batch.mask] == 0).all()


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_sepa_equals_retrain_pooling_then_gtpo_weighting(seed, lam):
    batch = make_batch(8, 7, 4, seed=seed, lengths=[7, 3, 1, 5, 4, 7, 6, 2], dtype=torch.float64)
    pm = batch.planning_mask.clone()
    pm[3] = 1  # a response with no execution token: pooling leaves it alone
    batch = batch.replace(planning_mask=pm, logprobs=batch.logprobs.clone().index_fill_(1, torch.tensor([0]), -80.0))
    adv = CreditPipeline("grpo")(batch).advantages
    out = sepa(batch, adv, SEPAConfig(lam=lam)).advantages
    for b, pos in enumerate(_rows(batch)):
        s = (-batch.logprobs[b, pos]).tolist()  # token 0 has surprisal 80: capped at 50
        plan = batch.planning_mask[b, pos].tolist()
        want = ref_gtpo(float(adv[b, pos[0]]), ref_sepa_pool(s, plan, lam))
        assert out[b, pos].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    # padding changes nothing
    padded = sepa(pad_batch(batch, 2), torch.cat([adv, torch.full((8, 2), math.nan, dtype=adv.dtype)], 1), SEPAConfig(lam=lam))
    torch.testing.assert_close(padded.advantages[:, :7], out)


def test_sepa_pooling_flattens_execution_weights_and_keeps_planning_ones():
    # one response, A = 1: planning token 0 (surprisal 3), execution tokens 1, 2, 4 and 0.5
    lp = torch.tensor([[-3.0, -1.0, -2.0, -4.0, -0.5]], dtype=torch.float64)
    b = CreditBatch(response_mask=torch.ones(1, 5), rewards=torch.ones(1, dtype=torch.float64),
                    group_ids=torch.zeros(1, dtype=torch.long), logprobs=lp,
                    planning_mask=torch.tensor([[1, 0, 0, 0, 0]]))
    a = torch.ones(1, 5, dtype=torch.float64)
    w0 = sepa(b, a, SEPAConfig(lam=0.0)).token_weights[0]
    w1 = sepa(b, a, SEPAConfig(lam=1.0)).token_weights[0]
    # lam = 1: every execution token has the execution mean 1.875, so one weight for all of them
    assert float(w1[1:].max() - w1[1:].min()) < 1e-12 < float(w0[1:].max() - w0[1:].min())
    mean = (3.0 + 4 * 1.875) / 5
    assert float(w1[0]) == pytest.approx(1 + 0.1 * (3.0 / (mean + 1e-8) - 1))


def test_sepa_schedule_gate_and_state():
    c = SEPAController(SEPAConfig(steps=10, delay_steps=2, correct_rate_gate=0.5))
    failing = make_batch(4, 3, 2, seed=0).replace(rewards=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    passing = failing.replace(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    lams = []
    for batch in [failing] * 3 + [passing] * 4 + [failing] * 12:
        c.update(batch)
        lams.append(c.lam())
    # closed for 3 steps (25% correct < 50%), then open for good: (step - 2) / 10, capped at 1
    assert lams[:3] == [0.0] * 3
    assert lams[3:8] == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6])
    assert lams[-1] == 1.0
    d = c.state_dict()
    c2 = SEPAController(c.config)
    c2.load_state_dict(d)
    assert c2.lam() == c.lam() and c2.state_dict() == d
    with pytest.raises(KeyError, match="sepa state"):
        c2.load_state_dict({"step": 1})
    # the pipeline steps the controller before the credit (STARE's order), replays do not
    pipe = CreditPipeline("sepa", sepa={"steps": 1, "delay_steps": 0, "correct_rate_gate": 0.0})
    out = pipe(passing)
    assert out.metrics["sepa/lambda"] == 1.0 and pipe.states["sepa"].step == 1
    pipe(passing, update_state=False)
    assert pipe.states["sepa"].step == 1


def test_trainers_refuse_a_planning_mask_spec_in_one_line():
    for spec in ("hicra", "gtpo+sepa", "oppo+hicra"):
        with pytest.raises(PlanError) as ei:
            plan_signals(CreditPipeline(spec), lora=False)
        msg = str(ei.value)
        assert "planning_mask" in msg and "do not compute" in msg and "\n" not in msg, msg


def test_config_errors_name_the_field():
    for cls, kw, field in [(HICRAConfig, {"alpha": -0.1}, "hicra alpha"), (SEPAConfig, {"beta": -1.0}, "sepa beta"),
                           (SEPAConfig, {"steps": 1.5}, "sepa steps"), (SEPAConfig, {"lam": 2.0}, "sepa lam"),
                           (SEPAConfig, {"correct_rate_gate": 1.5}, "sepa correct_rate_gate")]:
        with pytest.raises(ValueError, match=field):
            cls(**kw)
    b = make_batch(4, 3, 2, seed=0)
    with pytest.raises(ValueError, match=r"planning_mask: expected 0/1 on valid positions, got 2"):
        b.replace(planning_mask=torch.full((4, 3), 2))
