"""STARE: entropy-gated top-P surprisal reweighting, and its controller."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.stare import StareConfig, StareController, stare, top_count

from helpers import make_batch, pad_batch

GATE_ON = 1e6  # an H_target no entropy reaches: the gate is always on


def _batch(logprobs, entropy=None, mask=None):
    lp = torch.as_tensor(logprobs, dtype=torch.float64)
    if mask is None:
        mask = torch.ones_like(lp, dtype=torch.int64)
    if entropy is None:
        entropy = torch.zeros_like(lp)
    B = lp.shape[0]
    return CreditBatch(
        response_mask=torch.as_tensor(mask),
        rewards=torch.zeros(B, dtype=torch.float64),
        group_ids=torch.zeros(B, dtype=torch.int64),
        logprobs=lp,
        entropy=torch.as_tensor(entropy, dtype=torch.float64),
    )


def _mixed_adv(batch, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch.mask.shape, generator=g, dtype=batch.logprobs.dtype)
    a[torch.rand(batch.mask.shape, generator=g) < 0.15] = 0.0
    return a * batch.fmask.to(a.dtype)


def _expected_k(P_pct, n):
    return 0 if n == 0 else max(1, math.ceil(Fraction(P_pct, 100) * n))


batch_params = st.tuples(st.integers(1, 3), st.integers(2, 4), st.integers(1, 9), st.integers(0, 10_000))


@settings(max_examples=30, deadline=None)
@given(params=batch_params, P_pct=st.integers(1, 100), variant=st.sampled_from(["O1", "C2"]))
def test_selects_exactly_ceil_P_of_each_sign_and_the_most_surprising(params, P_pct, variant):
    n_groups, gsize, T, seed = params
    b = make_batch(n_groups * gsize, T, gsize, seed=seed, signals=("logprobs", "entropy"))
    adv = _mixed_adv(b, seed)
    cfg = StareConfig(P=P_pct / 100, W=1.25, M=0.75, H_target=GATE_ON, variant=variant)
    out = stare(b, adv, cfg)
    s = -b.logprobs
    for sign, weight, active in ((1, 1.25, True), (-1, 0.75, variant == "C2")):
        cand = b.mask & (adv * sign > 0)
        sel = cand & (out.token_weights == weight)
        expect = _expected_k(P_pct, int(cand.sum())) if active else 0
        assert int(sel.sum()) == expect
        # every selected token is at least as surprising as every unselected candidate
        if 0 < expect < int(cand.sum()):
            assert s[sel].min() >= s[cand & ~sel].max()
    other = b.mask & (out.token_weights != 1.25) & (out.token_weights != 0.75)
    assert (out.token_weights[other] == 1.0).all()
    n = int(b.mask.sum())
    assert out.metrics["stare/selected_pos_frac"] == pytest.approx(
        _expected_k(P_pct, int((b.mask & (adv > 0)).sum())) / n)
    torch.testing.assert_close(out.advantages, out.token_weights * adv)


def test_top_count_is_not_fooled_by_float_rounding():
    n = torch.tensor([0, 1, 9, 10, 11, 30, 70])
    assert top_count(0.1, n).tolist() == [0, 1, 1, 1, 2, 3, 7]
    assert top_count(1.0, n).tolist() == n.tolist()
    # 0.07 * 100 = 7.000000000000001 and 0.28 * 25 = 7.000000000000001 in floating point
    assert top_count(0.07, torch.tensor([100])).tolist() == [7]
    assert top_count(0.28, torch.tensor([25, 26])).tolist() == [7, 8]


def test_hand_case_gate_on_and_off():
    # surprisal 1..4 on row 0 (A > 0) and row 1 (A < 0); entropy mean 0.2 < 0.3
    lp = -torch.tensor([[1.0, 4.0, 2.0, 3.0], [3.0, 1.0, 4.0, 2.0]], dtype=torch.float64)
    ent = torch.full((2, 4), 0.2, dtype=torch.float64)
    b = _batch(lp, ent)
    adv = torch.tensor([[2.0] * 4, [-1.0] * 4], dtype=torch.float64)
    out = stare(b, adv, StareConfig(P=0.5, variant="C2"))
    w = torch.tensor([[1.0, 1.1, 1.0, 1.1], [0.9, 1.0, 0.9, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(out.token_weights, w)
    torch.testing.assert_close(out.advantages, w * adv)
    assert out.metrics["stare/gate"] == 1.0
    assert out.metrics["stare/entropy_mean"] == pytest.approx(0.2)
    assert out.metrics["stare/selected_pos_frac"] == pytest.approx(2 / 8)
    assert out.metrics["stare/selected_neg_frac"] == pytest.approx(2 / 8)
    # O1 selects only in T+
    out = stare(b, adv, StareConfig(P=0.5))
    assert torch.equal(out.advantages[1], adv[1]) and out.metrics["stare/selected_neg_frac"] == 0.0
    # entropy at or above the target: gate off, credit uniform (unchanged bitwise)
    for h in (0.3, 0.5):
        out = stare(b.replace(entropy=torch.full((2, 4), h, dtype=torch.float64)), adv, StareConfig(P=0.5, variant="C2"))
        assert out.metrics["stare/gate"] == 0.0
        assert torch.equal(out.advantages, adv)
        assert (out.token_weights == 1.0).all()


@settings(max_examples=30, deadline=None)
@given(params=batch_params, variant=st.sampled_from(["O1", "C2"]))
def test_gate_off_reverts_to_uniform(params, variant):
    n_groups, gsize, T, seed = params
    b = make_batch(n_groups * gsize, T, gsize, seed=seed, signals=("logprobs", "entropy"))
    adv = _mixed_adv(b, seed)
    out = stare(b, adv, StareConfig(variant=variant, P=0.5, H_target=0.0))
    assert out.metrics["stare/gate"] == 0.0
    assert torch.equal(out.advantages, adv)


def test_gate_reads_the_whole_batch_token_mean_entropy():
    # token mean = (0.1 * 3 + 0.9) / 4 = 0.3 -> not below 0.3; a row mean would give 0.2 -> on
    ent = torch.tensor([[0.1, 0.1, 0.1, 0.0], [0.9, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    b = _batch(-torch.ones(2, 4), ent, mask)
    out = stare(b, torch.ones(2, 4, dtype=torch.float64) * mask, StareConfig())
    assert out.metrics["stare/entropy_mean"] == pytest.approx(0.3)
    assert out.metrics["stare/gate"] == 0.0


def test_ties_are_broken_by_position_and_padding_invariant():
    b = _batch(torch.full((2, 5), -1.0), mask=[[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv = torch.ones(2, 5, dtype=torch.float64) * b.fmask
    cfg = StareConfig(P=0.25, H_target=GATE_ON)  # 8 candidates -> k = 2
    out = stare(b, adv, cfg)
    assert out.token_weights[b.mask].tolist() == [1.1, 1.1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    pout = stare(pad_batch(b, 2), torch.cat([adv, torch.zeros(2, 2, dtype=adv.dtype)], 1), cfg)
    assert torch.equal(pout.advantages[:, :5], out.advantages)


def test_micro_batch_selection_differs_from_batch_selection():
    # rows 0-1 are surprising, rows 2-3 are not: over the batch the top half is rows 0-1; per
    # micro-batch of 2 rows each chunk gives up its own top half
    lp = -torch.tensor([[5.0, 6.0], [7.0, 8.0], [1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    b = _batch(lp)
    adv = torch.ones(4, 2, dtype=torch.float64)
    whole = stare(b, adv, StareConfig(P=0.5))
    assert (whole.token_weights[:2] == 1.1).all() and (whole.token_weights[2:] == 1.0).all()
    micro = stare(b, adv, StareConfig(P=0.5, selection="micro_batch", micro_batch_size=2))
    w = torch.tensor([[1.0, 1.0], [1.1, 1.1], [1.0, 1.0], [1.1, 1.1]], dtype=torch.float64)
    torch.testing.assert_close(micro.token_weights, w)
    # a last, short chunk is ranked on its own
    micro3 = stare(b, adv, StareConfig(P=0.5, selection="micro_batch", micro_batch_size=3))
    assert micro3.token_weights[3].tolist() == [1.0, 1.1]
    # micro-batch size >= B is batch selection
    big = stare(b, adv, StareConfig(P=0.5, selection="micro_batch", micro_batch_size=4))
    assert torch.equal(big.advantages, whole.advantages)


def _entropy_batch(h):
    return _batch(-torch.ones(2, 3), torch.full((2, 3), float(h)))


def test_controller_follows_schedule_with_clipping():
    ctl = StareController(StareConfig(adaptive=True, W=1.45, M=0.55, a=0.02, w_max=1.5, m_min=0.5, H_target=0.3))
    seen = []
    for h in [0.1, 0.1, 0.1, 0.3, 0.9, 0.9]:
        # a single-token batch makes Hbar exactly h (0.3: at the target, sgn = 0, no move)
        m = ctl.update(_batch(-torch.ones(1, 1), torch.full((1, 1), h, dtype=torch.float64)))
        assert m["stare/W_next"] == ctl.W and m["stare/M_next"] == ctl.M
        seen += [ctl.W, ctl.M]
    want = [(1.47, 0.53), (1.49, 0.51), (1.5, 0.5), (1.5, 0.5), (1.48, 0.52), (1.46, 0.54)]
    assert seen == pytest.approx([x for pair in want for x in pair])
    assert ctl.step == 6
    # clipping at the lower end of W and the upper end of M
    ctl = StareController(StareConfig(adaptive=True, W=1.01, M=0.99, a=0.02))
    ctl.update(_entropy_batch(2.0))
    assert (ctl.W, ctl.M) == (1.0, 1.0)
    ctl.update(_entropy_batch(2.0))
    assert (ctl.W, ctl.M) == (1.0, 1.0)


def test_controller_is_a_no_op_unless_adaptive_and_round_trips():
    ctl = StareController(StareConfig())
    for _ in range(3):
        ctl.update(_entropy_batch(0.0))
    assert (ctl.W, ctl.M, ctl.step) == (1.1, 0.9, 3)
    ctl = StareController(StareConfig(adaptive=True))
    for h in (0.0, 0.0, 1.0, 0.0):
        ctl.update(_entropy_batch(h))
    sd = ctl.state_dict()
    assert sd == pytest.approx({"W": 1.12, "M": 0.88, "step": 4})
    assert type(sd["W"]) is float and type(sd["M"]) is float and type(sd["step"]) is int
    other = StareController(StareConfig(adaptive=True))
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    b = _batch(-torch.tensor([[1.0, 2.0, 3.0]]), torch.zeros(1, 3))
    adv = torch.ones(1, 3, dtype=torch.float64)
    torch.testing.assert_close(stare(b, adv, other.config, other).advantages, stare(b, adv, ctl.config, ctl).advantages)
    assert stare(b, adv, other.config, other).metrics["stare/W"] == pytest.approx(1.12)
    with pytest.raises(KeyError, match="stare state"):
        other.load_state_dict({"W": 1.0})
    with pytest.raises(ValueError, match="step"):
        other.load_state_dict({"W": 1.0, "M": 1.0, "step": -1})
    with pytest.raises(ValueError, match="W"):
        other.load_state_dict({"W": float("nan"), "M": 1.0, "step": 0})


def test_without_state_the_config_weights_are_used():
    b = _batch(-torch.tensor([[1.0, 2.0]]))
    out = stare(b, torch.ones(1, 2, dtype=torch.float64), StareConfig(W=1.3, w_max=1.5), None)
    assert out.token_weights.tolist() == [[1.0, 1.3]] and out.metrics["stare/W"] == 1.3


def test_pipeline_steps_the_state_first_then_credits_with_it():
    # the reference order (recipe/STARE/stare_ray_trainer.py): the controller steps from the
    # step's pre-update entropy, then that step's loss reads the updated W
    b = make_batch(8, 6, 4, seed=4)
    p = CreditPipeline("stare", stare={"adaptive": True, "H_target": GATE_ON, "P": 0.5})
    adv0 = p.estimator.fn(b, p.configs["grpo"]).advantages
    out1 = p(b)
    assert p.states["stare"].step == 1 and p.states["stare"].W == pytest.approx(1.11)
    assert out1.metrics["stare/W"] == pytest.approx(1.11)  # credit uses W after this step's update
    # the controller's own metrics reach the caller
    assert out1.metrics["stare/W_next"] == pytest.approx(1.11) and out1.metrics["stare/controller_step"] == 1.0
    # the largest reweighted token carries exactly the updated W
    ratio = (out1.advantages / adv0.where(adv0 != 0, torch.ones_like(adv0)))[b.mask & (adv0 > 0)]
    assert float(ratio.max()) == pytest.approx(1.11)
    out2 = p(b)
    assert p.states["stare"].step == 2 and p.states["stare"].W == pytest.approx(1.12)
    assert out2.metrics["stare/W"] == pytest.approx(1.12)
    # a replay reads the state without moving it
    out3 = p(b, update_state=False)
    assert p.states["stare"].step == 2 and out3.metrics["stare/W"] == pytest.approx(1.12)
    assert "stare/W_next" not in out3.metrics
    torch.testing.assert_close(out3.advantages, out2.advantages)


def test_finite_masked_and_padding_invariant():
    b = make_batch(8, 6, 4, seed=9, lengths=[6, 0, 3, 1, 6, 2, 5, 4], signals=("logprobs", "entropy"))
    adv = _mixed_adv(b, 5)
    for cfg in (StareConfig(variant="C2", P=0.3, H_target=GATE_ON),
                StareConfig(variant="C2", P=0.3, H_target=GATE_ON, selection="micro_batch", micro_batch_size=3)):
        out = stare(b, adv, cfg)
        assert torch.isfinite(out.advantages).all()
        assert (out.advantages[~b.mask] == 0).all() and (out.advantages[1] == 0).all()
        pout = stare(pad_batch(b, 4), torch.cat([adv, torch.full((8, 4), float("nan"))], 1), cfg)
        assert torch.equal(pout.advantages[:, :6], out.advantages)
        assert (pout.advantages[:, 6:] == 0).all()


@pytest.mark.parametrize("bad,field", [
    ({"variant": "X"}, "variant"), ({"P": 0.0}, "P"), ({"P": 1.5}, "P"), ({"W": 0.9}, "W"),
    ({"W": 2.0}, "W"), ({"M": 1.1}, "M"), ({"M": 0.4}, "M"), ({"m_min": 0.0}, "m_min"),
    ({"w_max": 0.5}, "w_max"), ({"a": -0.1}, "a"), ({"H_target": -1.0}, "H_target"),
    ({"adaptive": 1}, "adaptive"), ({"selection": "x"}, "selection"),
    ({"selection": "micro_batch"}, "micro_batch_size"), ({"micro_batch_size": 0}, "micro_batch_size"),
])
def test_config_errors(bad, field):
    with pytest.raises(ValueError, match=field):
        CreditPipeline("stare", stare=bad)


def test_input_errors():
    b = make_batch(8, 6, 4, seed=2)
    with pytest.raises(CreditInputError, match="logprobs"):
        CreditPipeline("stare")(b.replace(logprobs=None))
    with pytest.raises(CreditInputError, match="entropy"):
        CreditPipeline("stare")(b.replace(entropy=None))
    with pytest.raises(CreditInputError, match="advantages"):
        stare(b, torch.zeros(7, 6), StareConfig())
