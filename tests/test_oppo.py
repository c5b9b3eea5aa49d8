"""OPPO (oracle-prompted belief recursion) and OPD (on-policy distillation reward)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.opd import OPDConfig, opd
from tokencredit.credit.methods.oppo import (
    DEFAULT_ORACLE_TEMPLATE,
    OPPOConfig,
    _top_mass,
    belief_trajectory,
    oppo,
    oracle_prompt,
)

from helpers import make_batch, pad_batch

L = math.log


def _batch(mask, rewards, logprobs, oracle, groups=None, dtype=torch.float64):
    mask = torch.as_tensor(mask)
    B = mask.shape[0]
    return CreditBatch(
        response_mask=mask,
        rewards=torch.as_tensor(rewards, dtype=dtype),
        group_ids=torch.as_tensor(groups if groups is not None else [0] * B),
        logprobs=torch.as_tensor(logprobs, dtype=dtype),
        oracle_logprobs=torch.as_tensor(oracle, dtype=dtype),
    )


@st.composite
def oppo_batches(draw, dtype=torch.float64):
    """Groups of 2-4 responses; masks with holes, empty rows and NaN padding; rewards in [0, 1]."""
    n_groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(2, 4)) for _ in range(n_groups)]
    B, T = sum(sizes), draw(st.integers(1, 7))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) < draw(st.sampled_from([0.5, 0.8, 1.0]))
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    mask[starts, torch.randint(0, T, (n_groups,), generator=gen)] = True  # no group without a token
    binary = draw(st.booleans())
    rewards = (torch.rand(B, generator=gen) < 0.5).to(dtype) if binary else torch.rand(B, generator=gen, dtype=dtype)
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))
    logp = -torch.rand(B, T, generator=gen, dtype=dtype) * 3
    oracle = logp + scale * torch.randn(B, T, generator=gen, dtype=dtype)
    logp = torch.where(mask, logp, torch.full_like(logp, float("nan")))
    groups = torch.repeat_interleave(torch.arange(n_groups) * 5 + 1, torch.tensor(sizes))
    return CreditBatch(response_mask=mask.long(), rewards=rewards, group_ids=groups, logprobs=logp, oracle_logprobs=oracle)


def _prior(batch, cfg):
    r = batch.rewards
    ids = batch.group_ids
    out = torch.empty_like(r)
    for b in range(len(r)):
        same = ids == ids[b]
        if cfg.prior == "group_mean":
            out[b] = r[same].mean()
        else:
            others = same.clone()
            others[b] = False
            out[b] = r[others].mean()
    return out.clamp(cfg.eps, 1 - cfg.eps)


def _seq_adv(batch):
    r, ids = batch.rewards, batch.group_ids
    return torch.stack([r[b] - r[ids == ids[b]].mean() for b in range(len(r))])


# ---- oracle prompt -------------------------------------------------------------------


def test_oracle_prompt_fills_template_in_one_pass():
    x = oracle_prompt("What is 2+2?", "4")
    assert x == DEFAULT_ORACLE_TEMPLATE.replace("{prompt}", "What is 2+2?").replace("{answer}", "4")
    assert "What is 2+2?" in x and "4" in x
    # braces elsewhere in the template and placeholders inside the values stay literal
    t = "Q: {prompt}\nBoxed: \\boxed{{x}} answer {answer}"
    assert oracle_prompt("say {answer}", "{prompt}", t) == "Q: say {answer}\nBoxed: \\boxed{{x}} answer {prompt}"
    assert oracle_prompt("p", 7, "{prompt}|{answer}") == "p|7"
    with pytest.raises(ValueError, match="template"):
        oracle_prompt("p", "a", "no answer slot: {prompt}")
    with pytest.raises(ValueError, match="oracle_template"):
        OPPOConfig(oracle_template="{answer} only")


# ---- the recursion -------------------------------------------------------------------


PROB = dict(form="probability", anchor="off")  # the earlier reconstruction, unanchored
RAW = dict(anchor="off")  # the default log-odds recursion, unanchored


def test_default_is_the_log_odds_recursion_with_anchoring():
    cfg = OPPOConfig()
    assert (cfg.form, cfg.anchor) == ("log_odds", "flip")


def test_hand_computed_log_odds_recursion_with_a_hole_and_padding():
    nan = float("nan")
    mask = [[1, 1, 1, 0], [1, 0, 1, 0]]
    logp = [[-1.0, -1.0, -1.0, nan], [-1.0, nan, -2.0, nan]]
    # evidence e = log-odds increments: row 0 log 3, -log 1.5, log 5; row 1 log 3, (hole), log 7
    oracle = [[-1.0 + L(3.0), -1.0 - L(1.5), -1.0 + L(5.0), nan], [-1.0 + L(3.0), 5.0, -2.0 + L(7.0), nan]]
    batch = _batch(mask, [1.0, 0.0], logp, oracle)
    out = oppo(batch, OPPOConfig(evidence_clip=math.inf, **RAW))
    # prior 0.5 = odds 1. Row 0 odds 1 -> 3 -> 2 -> (10, final belief 10/11) -> V := R = 1:
    # V 0.5 -> 3/4 -> 2/3 -> 1. Row 1 odds 1 -> 3 -> (hole) -> (21, belief 21/22) -> V := R = 0.
    expect = torch.tensor([[0.25, 2 / 3 - 0.75, 1 / 3, 0.0], [0.25, 0.0, -0.75, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expect)
    assert out.metrics["oppo/prior_mean"] == pytest.approx(0.5)
    assert out.metrics["oppo/final_belief_mean"] == pytest.approx((10 / 11 + 21 / 22) / 2)
    assert out.metrics["oppo/final_belief_brier"] == pytest.approx(((1 - 10 / 11) ** 2 + (21 / 22) ** 2) / 2)
    # |A| on the last token: row 0 (1/3) / (1/4 + 1/12 + 1/3), row 1 0.75 / 1
    assert out.metrics["oppo/last_token_credit_share"] == pytest.approx((0.5 + 0.75) / 2)
    # the probability form on the same evidence: 0.5 -> clamp(1.5) = 0.999 -> 0.666 -> R = 1
    prob = oppo(batch, OPPOConfig(evidence_clip=math.inf, **PROB)).advantages
    assert prob[0, 0].item() == pytest.approx(0.499)
    assert prob[0, 1].item() == pytest.approx(0.999 / 1.5 - 0.999)
    # a clip at log 2 binds on log 3 (both rows), log 5 and log 7: row 0 odds 1 -> 2 -> 4/3 -> R
    clipped = oppo(batch, OPPOConfig(evidence_clip=L(2.0), **RAW))
    torch.testing.assert_close(clipped.advantages[0, :2], torch.tensor([2 / 3 - 0.5, 4 / 7 - 2 / 3], dtype=torch.float64))
    assert clipped.metrics["oppo/clip_frac"] == pytest.approx(4 / 5)


def test_hand_computed_probability_form_with_a_hole_and_padding():
    nan = float("nan")
    mask = [[1, 1, 1, 0], [1, 0, 1, 0]]
    logp = [[-1.0, -1.0, -1.0, nan], [-1.0, nan, -2.0, nan]]
    # evidence e = oracle - logp: row 0 ratios 1.2, 0.5, 3; row 1 ratio 1.5, (hole), 2
    oracle = [[-1.0 + L(1.2), -1.0 + L(0.5), -1.0 + L(3.0), nan], [-1.0 + L(1.5), 5.0, -2.0 + L(2.0), nan]]
    batch = _batch(mask, [1.0, 0.0], logp, oracle)
    out = oppo(batch, OPPOConfig(evidence_clip=math.inf, **PROB))
    # prior 0.5; row 0: 0.5 -> 0.6 -> 0.3 -> R = 1; row 1: 0.5 -> 0.75 -> (hole) -> R = 0
    expect = torch.tensor([[0.1, -0.3, 0.7, 0.0], [0.25, 0.0, -0.75, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expect)
    assert out.metrics["oppo/prior_mean"] == pytest.approx(0.5)
    # final beliefs before V := R: 0.3 * 3 = 0.9 and 0.75 * 2 -> clamped to 1 - eps
    assert out.metrics["oppo/final_belief_mean"] == pytest.approx((0.9 + 0.999) / 2)
    assert out.metrics["oppo/final_belief_brier"] == pytest.approx((0.1**2 + 0.999**2) / 2)
    assert out.metrics["oppo/belief_bound_frac"] == pytest.approx(1 / 5)
    # a clip just under log 2 binds on |log 0.5|, log 3 and log 2 (3 of 5 tokens) but moves the
    # belief by ~1e-9 only: the last two are overwritten by the terminal V := R
    clipped = oppo(batch, OPPOConfig(evidence_clip=L(2.0) - 1e-9, **PROB))
    torch.testing.assert_close(clipped.advantages, expect, atol=1e-8, rtol=0)
    assert clipped.metrics["oppo/clip_frac"] == pytest.approx(3 / 5)
    # a clip at log 1.3 binds on row 0's second token: 0.6 / 1.3 instead of 0.3
    tight = oppo(batch, OPPOConfig(evidence_clip=L(1.3), **PROB)).advantages
    assert tight[0, 1].item() == pytest.approx(0.6 / 1.3 - 0.6)
    assert tight[0].sum().item() == pytest.approx(0.5)


def test_first_order_forms_are_the_source_linearisations():
    # prior 0.25, where the two weights differ: V(1 - V) = 0.1875, V = 0.25
    mask = [[1, 1]] * 4
    logp = [[-1.0, -1.0]] * 4
    oracle = [[-1.0 + L(1.2), -1.0 + L(0.5)], [-1.0, -1.0 + L(2.0)], [-1.0, -1.0], [-1.0, -1.0]]
    batch = _batch(mask, [1.0, 0.0, 0.0, 0.0], logp, oracle)
    e = torch.tensor([[L(1.2), L(0.5)], [0.0, L(2.0)], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    v0 = 0.25
    # the digest's first order A_t ~ V (1 - V) log lambda_t; without accumulation V = V_0
    lo = oppo(batch, OPPOConfig(accumulate=False, **RAW)).advantages
    torch.testing.assert_close(lo, v0 * (1 - v0) * e)
    # the probability form V_t = V_{t-1} exp(e_t) linearises to V e_t
    pr = oppo(batch, OPPOConfig(accumulate=False, **PROB)).advantages
    torch.testing.assert_close(pr, v0 * e)
    # the first order is the linearisation of the recursion in use: small evidence, exact
    # first increment / first-order credit -> 1 (and not for the other form's weight)
    small = _batch(mask, [1.0, 0.0, 0.0, 0.0], logp, [[-1.0 + 1e-5, -1.0]] + [[-1.0, -1.0]] * 3)
    for raw in (RAW, PROB):
        exact = oppo(small, OPPOConfig(**raw)).advantages[0, 0].item()
        first = oppo(small, OPPOConfig(accumulate=False, **raw)).advantages[0, 0].item()
        assert exact / first == pytest.approx(1.0, abs=1e-4)


@settings(max_examples=30, deadline=None)
@given(batch=oppo_batches(), prior=st.sampled_from(["group_mean", "leave_one_out"]),
       clip=st.sampled_from([0.5, 5.0, math.inf]), eps=st.sampled_from([1e-3, 0.1]), extra=st.integers(0, 3),
       form=st.sampled_from(["log_odds", "probability"]))
def test_credits_telescope_to_outcome_minus_prior(batch, prior, clip, eps, extra, form):
    cfg = OPPOConfig(prior=prior, evidence_clip=clip, eps=eps, form=form, anchor="off")
    padded = pad_batch(batch, extra) if extra else batch
    adv = oppo(padded, cfg).advantages
    assert torch.isfinite(adv).all()
    assert (adv[~padded.mask] == 0).all()
    nonempty = batch.mask.any(1)
    expect = torch.where(nonempty, batch.rewards - _prior(batch, cfg), torch.zeros_like(batch.rewards))
    torch.testing.assert_close(adv.sum(1), expect, atol=1e-9, rtol=0)
    # padding never changes credit on the original columns
    torch.testing.assert_close(adv[:, : batch.mask.shape[1]], oppo(batch, cfg).advantages)


@settings(max_examples=30, deadline=None)
@given(batch=oppo_batches(), eps=st.sampled_from([1e-3, 0.2]), scale=st.sampled_from([1.0, 50.0, 1e4]))
def test_belief_stays_in_eps_band(batch, eps, scale):
    e = torch.where(batch.mask, scale * (batch.oracle_logprobs - batch.logprobs), torch.zeros_like(batch.logprobs))
    v0 = torch.rand(batch.batch_size, dtype=e.dtype).clamp(eps, 1 - eps)
    before, after = belief_trajectory(v0, e, batch.mask, eps, "probability")
    for v in (before, after):
        assert torch.isfinite(v).all()
        assert (v >= eps).all() and (v <= 1 - eps).all()
    # at a masked position the belief does not move
    assert (after[~batch.mask] == before[~batch.mask]).all()


@settings(max_examples=30, deadline=None)
@given(batch=oppo_batches(), scale=st.sampled_from([1.0, 50.0]))
def test_log_odds_belief_is_a_sigmoid_of_the_summed_evidence(batch, scale):
    e = scale * (batch.oracle_logprobs - batch.logprobs)
    e = torch.where(batch.mask, e, torch.full_like(e, float("nan")))  # padding must never be read
    v0 = torch.rand(batch.batch_size, dtype=e.dtype, generator=torch.Generator().manual_seed(0)).clamp(0.01, 0.99)
    before, after = belief_trajectory(v0, e, batch.mask, 1e-3, "log_odds")
    # a direct loop over l_t = l_{t-1} + e_t
    lo = torch.logit(v0)
    for t in range(e.shape[1]):
        torch.testing.assert_close(before[:, t], torch.sigmoid(lo))
        lo = torch.where(batch.mask[:, t], lo + torch.nan_to_num(e[:, t]), lo)
        torch.testing.assert_close(after[:, t], torch.sigmoid(lo))
    assert torch.isfinite(after).all() and ((after >= 0) & (after <= 1)).all()
    assert torch.equal(before[:, 1:], after[:, :-1])  # exact telescoping


# OPPO = OPD ("self-oracle recovers the on-policy distillation reward as a strict special case"):
# exactly when the state weight is off, anchoring is off and the two clips are the same; every
# other switch (accumulate, form, prior, eps) then has no effect on the advantage
OPD_CASE = dict(state_weight=False, anchor="off")


@settings(max_examples=40, deadline=None)
@given(batch=oppo_batches(), clip=st.sampled_from([0.3, 2.0, math.inf]), accumulate=st.booleans(),
       form=st.sampled_from(["log_odds", "probability"]), prior=st.sampled_from(["group_mean", "leave_one_out"]),
       eps=st.sampled_from([1e-3, 0.2]))
def test_equals_opd_without_state_weight(batch, clip, accumulate, form, prior, eps):
    a = oppo(batch, OPPOConfig(accumulate=accumulate, evidence_clip=clip, form=form, prior=prior, eps=eps, **OPD_CASE)).advantages
    b = opd(batch, OPDConfig(clip=None if math.isinf(clip) else clip)).advantages
    assert torch.equal(a, b)
    if math.isinf(clip):  # OPD at its defaults (no clip) is OPPO with evidence_clip=math.inf
        assert torch.equal(a, opd(batch, OPDConfig()).advantages)


def _opd_departures_batch():
    """Two responses (R = 1, 0) whose evidence has a token against the outcome's direction
    (e = -0.5 in the success, +0.5 in the failure) and one beyond OPPO's default clip (e = 7)."""
    logp = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    e = [[0.4, -0.5, 7.0], [0.5, -0.3, -0.2]]
    oracle = [[lp + x for lp, x in zip(r, er)] for r, er in zip(logp, e)]
    return _batch([[1, 1, 1], [1, 1, 1]], [1.0, 0.0], logp, oracle)


@pytest.mark.parametrize("kw,where", [
    ({}, "all"),  # OPPO's defaults: state weight, anchor flip, clip 5
    ({"evidence_clip": math.inf, "anchor": "off"}, "all"),  # the state weight alone: the belief increments
    ({"evidence_clip": math.inf, "anchor": "off", "accumulate": False}, "all"),  # first order V0(1 - V0) e
    ({"state_weight": False, "anchor": "off"}, [(0, 2)]),  # OPPO's evidence clip 5 against OPD's none
    ({"state_weight": False, "evidence_clip": math.inf}, [(0, 1), (1, 0)]),  # anchor "flip": |e| sign(A_b)
    ({"state_weight": False, "evidence_clip": math.inf, "anchor": "zero"}, [(0, 1), (1, 0)]),  # disagreeing tokens -> 0
], ids=["defaults", "state_weight", "state_weight_first_order", "evidence_clip_5", "anchor_flip", "anchor_zero"])
def test_differs_from_opd_outside_the_special_case(kw, where):
    """Each setting that departs from the special case changes the advantage away from OPD's
    reward (at its defaults, no clip), on exactly the tokens it should."""
    batch = _opd_departures_batch()
    a = oppo(batch, OPPOConfig(**kw)).advantages
    b = opd(batch, OPDConfig()).advantages
    differ = {tuple(i) for i in (a != b).nonzero().tolist()}
    if where == "all":
        assert differ == {(i, t) for i in range(2) for t in range(3)}
    else:
        assert differ == set(where)


@pytest.mark.parametrize("mode", ["zero", "flip"])
@settings(max_examples=30, deadline=None)
@given(batch=oppo_batches(), accumulate=st.booleans(), state_weight=st.booleans(),
       form=st.sampled_from(["log_odds", "probability"]))
def test_anchoring_agrees_with_the_outcome_direction(mode, batch, accumulate, state_weight, form):
    kw = dict(accumulate=accumulate, state_weight=state_weight, form=form)
    free_out = oppo(batch, OPPOConfig(anchor="off", **kw))
    free = free_out.advantages
    out = oppo(batch, OPPOConfig(anchor=mode, **kw))
    adv = out.advantages
    s = torch.sign(_seq_adv(batch)).unsqueeze(1).expand_as(adv)
    nz = adv != 0
    assert (torch.sign(adv[nz]) == s[nz]).all()
    assert (adv[s == 0] == 0).all()  # no outcome direction -> no credit
    # the metric reports the oracle's own agreement, before anchoring forces it
    assert out.metrics["oppo/sign_agree_frac"] == free_out.metrics["oppo/sign_agree_frac"]
    if mode == "zero":
        keep = torch.sign(free) == s
        assert torch.equal(adv[keep], free[keep])
    else:
        live = (s != 0) & batch.mask
        assert torch.equal(adv[live].abs(), free[live].abs())


def test_credit_concentration_metric():
    mask = torch.ones(2, 20, dtype=torch.bool)
    one_hot = torch.zeros(2, 20)
    one_hot[0, 3] = -2.0
    one_hot[1] = 1.0
    # row 0: all mass on 1 token -> 1.0; row 1 uniform: top ceil(2) of 20 -> 0.1
    assert _top_mass(one_hot, mask) == pytest.approx((1.0 + 0.1) / 2)
    mask[1, 5:] = False  # 5 valid uniform tokens: top ceil(0.5) = 1 -> 0.2
    assert _top_mass(one_hot, mask) == pytest.approx((1.0 + 0.2) / 2)
    mask[1, :] = True
    one_hot[1] = 1.0
    wide = torch.ones(1, 30)  # 30 uniform tokens: exactly 3 on top, not 4 (float ceil(30 * 0.1))
    assert _top_mass(wide, wide.bool()) == pytest.approx(0.1)
    assert _top_mass(torch.zeros(2, 20), mask) == 0.0


def test_metrics_finite_and_namespaced_on_a_realistic_batch():
    batch = make_batch(8, 6, 4, seed=3, binary_rewards=False)
    out = CreditPipeline("oppo")(batch)
    assert out.metrics and all(k.startswith("oppo/") for k in out.metrics)
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert 0.0 < out.metrics["oppo/credit_top10pct_mass"] <= 1.0


def test_credit_is_detached():
    batch = make_batch(4, 5, 2, seed=0)
    lp = batch.logprobs.clone().requires_grad_(True)
    ol = batch.oracle_logprobs.clone().requires_grad_(True)
    b = batch.replace(logprobs=lp, oracle_logprobs=ol)
    assert not oppo(b, OPPOConfig()).advantages.requires_grad
    assert not opd(b, OPDConfig()).advantages.requires_grad


# ---- errors --------------------------------------------------------------------------


def test_rewards_outside_unit_interval_rejected():
    batch = make_batch(4, 5, 2, seed=0)
    bad = batch.replace(rewards=torch.tensor([1.0, 0.0, 1.5, 0.0]))
    with pytest.raises(CreditInputError, match="rewards"):
        CreditPipeline("oppo")(bad)
    with pytest.raises(CreditInputError, match="rewards"):
        CreditPipeline("oppo")(batch.replace(rewards=torch.tensor([1.0, -1.0, 1.0, 0.0])))


@pytest.mark.parametrize("spec,missing", [("oppo", "oracle_logprobs"), ("oppo", "logprobs"),
                                          ("opd", "oracle_logprobs"), ("opd", "logprobs")])
def test_missing_signal_named(spec, missing):
    batch = make_batch(4, 5, 2, seed=0)
    with pytest.raises(CreditInputError, match=missing):
        CreditPipeline(spec)(batch.replace(**{missing: None}))


def test_singleton_group_rejected():
    batch = make_batch(4, 5, 2, seed=0).replace(group_ids=torch.tensor([0, 0, 1, 2]))
    with pytest.raises(CreditInputError, match="group_ids"):
        CreditPipeline("oppo")(batch)
    CreditPipeline("opd")(batch)  # OPD needs no groups


def test_wrong_shape_rejected():
    batch = make_batch(4, 5, 2, seed=0)
    with pytest.raises(CreditInputError, match="oracle_logprobs"):
        batch.replace(oracle_logprobs=torch.zeros(4, 6))


@pytest.mark.parametrize("kw,field", [
    ({"evidence_clip": 0.0}, "evidence_clip"), ({"evidence_clip": -1}, "evidence_clip"),
    ({"eps": 0.0}, "eps"), ({"eps": 0.5}, "eps"), ({"prior": "batch"}, "prior"),
    ({"accumulate": 1}, "accumulate"), ({"state_weight": "yes"}, "state_weight"),
    ({"anchor": "on"}, "anchor"), ({"anchor": False}, "quote it"), ({"oracle": "gpt"}, "oracle"),
    ({"oracle_template": 3}, "oracle_template"), ({"form": "logit"}, "form"),
])
def test_oppo_config_out_of_range(kw, field):
    with pytest.raises(ValueError, match=field):
        OPPOConfig(**kw)
    with pytest.raises(ValueError, match=field):
        CreditPipeline("oppo", oppo=kw)


# ---- OPD -----------------------------------------------------------------------------


def test_opd_hand_case_clip_and_coefficient():
    nan = float("nan")
    batch = _batch([[1, 1, 0], [1, 0, 1]], [1.0, 0.0], [[-1.0, -2.0, nan], [-0.5, nan, -3.0]],
                   [[-0.5, -5.0, nan], [-0.5, 0.0, -1.0]], dtype=torch.float32)
    out = CreditPipeline("opd")(batch)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, -3.0, 0.0], [0.0, 0.0, 2.0]]))
    assert out.metrics["opd/reward_mean"] == pytest.approx(-0.5 / 4)
    assert out.metrics["opd/reverse_kl_est"] == pytest.approx(0.5 / 4)
    out = CreditPipeline("opd", opd={"clip": 1.0, "coefficient": 2.0})(batch)
    torch.testing.assert_close(out.advantages, torch.tensor([[1.0, -2.0, 0.0], [0.0, 0.0, 2.0]]))
    assert out.metrics["opd/clip_frac"] == pytest.approx(2 / 4)


@settings(max_examples=30, deadline=None)
@given(batch=oppo_batches(dtype=torch.float32), extra=st.integers(1, 3))
def test_opd_finite_masked_and_padding_invariant(batch, extra):
    adv = CreditPipeline("opd")(batch).advantages
    assert torch.isfinite(adv).all() and (adv[~batch.mask] == 0).all()
    padded = CreditPipeline("opd")(pad_batch(batch, extra)).advantages
    assert torch.equal(padded[:, : adv.shape[1]], adv)


@pytest.mark.parametrize("kw,field", [({"clip": 0.0}, "clip"), ({"clip": -2}, "clip"),
                                      ({"coefficient": 0.0}, "coefficient"), ({"coefficient": math.inf}, "coefficient")])
def test_opd_config_out_of_range(kw, field):
    with pytest.raises(ValueError, match=field):
        OPDConfig(**kw)
