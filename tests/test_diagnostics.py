"""Credit diagnostics: Gini / ETR against their definitions, quadrants, masses, signs."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tokencredit as tc
from tokencredit import CreditInputError, CreditOutput, CreditPipeline
from tokencredit.credit.diagnostics import (
    credit_diagnostics,
    credit_mass,
    effective_token_ratio,
    entropy_stats,
    nonempty_row_mean,
    quadrant_fractions,
    sign_agreement,
    tail_token_fraction,
    weight_gini,
)

from helpers import make_batch, pad_batch


def _row(values, T=None):
    """One row of weights [1, T] with the first len(values) positions valid."""
    n = len(values)
    T = T or n
    w = torch.full((1, T), float("nan"), dtype=torch.float64)
    w[0, :n] = torch.tensor(values, dtype=torch.float64)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, :n] = True
    return w, mask


def gini_brute(x: torch.Tensor) -> float:
    """The n^2 definition sum_j sum_k |x_j - x_k| / (2 n^2 mean x), in exact rational
    arithmetic (a float64 oracle underflows: x^2 of 2.6e-188 is 0, which once made the oracle,
    not the code, wrong)."""
    v = [Fraction(float(t)) for t in x.tolist()]
    n = len(v)
    total = sum(v)
    if total == 0:
        return 0.0
    return float(sum(abs(a - b) for a in v for b in v) / (2 * n * total))


def etr_brute(x: torch.Tensor) -> float:
    v = [Fraction(float(t)) for t in x.tolist()]
    n = len(v)
    s2 = sum(t * t for t in v)
    if s2 == 0:
        return 1.0
    return float(sum(v) ** 2 / (n * s2))


# ---- Gini and ETR --------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_uniform_and_one_hot(n):
    w, m = _row([2.5] * n, T=n + 3)
    assert weight_gini(w, m).item() == pytest.approx(0.0, abs=1e-12)
    assert effective_token_ratio(w, m).item() == pytest.approx(1.0)
    hot = [0.0] * n
    hot[n // 2] = 4.0
    w, m = _row(hot, T=n + 3)
    assert weight_gini(w, m).item() == pytest.approx((n - 1) / n)
    assert effective_token_ratio(w, m).item() == pytest.approx(1 / n)


def test_hand_case_one_two_three():
    w, m = _row([3.0, 1.0, 2.0])
    # pairwise |diffs| sum to 8; mean 2 -> 8 / (2 * 9 * 2)
    assert weight_gini(w, m).item() == pytest.approx(2 / 9)
    # 6^2 / (3 * 14)
    assert effective_token_ratio(w, m).item() == pytest.approx(6 / 7)


def test_zero_and_empty_rows_are_uniform_never_nan():
    w = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3, [1.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0]]).bool()
    g, e = weight_gini(w, m), effective_token_ratio(w, m)
    assert torch.isfinite(g).all() and torch.isfinite(e).all()
    assert g[:2].tolist() == [0.0, 0.0] and e[:2].tolist() == [1.0, 1.0]
    # the empty row is left out of the batch mean: mean over rows 0 and 2
    assert nonempty_row_mean(g, m) == pytest.approx((0.0 + 0.5) / 2)
    assert nonempty_row_mean(e, m, empty=1.0) == pytest.approx((1.0 + 0.5) / 2)
    assert nonempty_row_mean(g, torch.zeros(3, 3, dtype=torch.bool), empty=0.0) == 0.0


def test_gini_of_one_to_n_in_n_log_n_memory():
    # closed form for w = 1..n is (n - 1) / (3 n); the n^2 table would need ~300 GB here
    n = 200_000
    w = torch.arange(1, n + 1, dtype=torch.float64).flip(0).unsqueeze(0)
    m = torch.ones(1, n, dtype=torch.bool)
    assert weight_gini(w, m).item() == pytest.approx((n - 1) / (3 * n), rel=1e-9)


def test_weights_taken_by_magnitude_and_scale_free():
    w, m = _row([1.0, -2.0, 3.0])
    a, _ = _row([1.0, 2.0, 3.0])
    assert weight_gini(w, m).item() == pytest.approx(weight_gini(a, m).item())
    assert weight_gini(a * 1e-300, m).item() == pytest.approx(weight_gini(a, m).item())
    assert effective_token_ratio(a * 1e200, m).item() == pytest.approx(effective_token_ratio(a, m).item())


rows = st.lists(
    st.lists(st.floats(0.0, 100.0, allow_nan=False, allow_subnormal=False), min_size=0, max_size=12),
    min_size=1,
    max_size=5,
)


@settings(max_examples=30, deadline=None)
@given(rows=rows, extra=st.integers(0, 3))
@example(rows=[[0.0, 2.589e-188]], extra=0)  # x^2 underflows float64: ETR is 1/2, not 1
def test_gini_and_etr_match_the_definitions(rows, extra):
    T = max(len(r) for r in rows) + extra
    w = torch.full((len(rows), max(T, 1)), float("nan"), dtype=torch.float64)
    m = torch.zeros(w.shape, dtype=torch.bool)
    for i, r in enumerate(rows):
        w[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        m[i, : len(r)] = True
    g, e = weight_gini(w, m), effective_token_ratio(w, m)
    for i, r in enumerate(rows):
        if not r:
            assert g[i] == 0 and e[i] == 1
            continue
        x = torch.tensor(r, dtype=torch.float64)
        n = len(r)
        assert g[i].item() == pytest.approx(gini_brute(x), abs=1e-9)
        assert e[i].item() == pytest.approx(etr_brute(x), rel=1e-9)
        assert -1e-12 <= g[i].item() <= (n - 1) / n + 1e-12
        assert 1 / n - 1e-12 <= e[i].item() <= 1 + 1e-12


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), extra=st.integers(1, 5))
def test_padding_invariance(seed, extra):
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(4, 6, generator=gen, dtype=torch.float64)
    m = torch.rand(4, 6, generator=gen) < 0.7
    wp = torch.cat([w, torch.full((4, extra), float("nan"), dtype=torch.float64)], 1)
    mp = torch.cat([m, torch.zeros(4, extra, dtype=torch.bool)], 1)
    torch.testing.assert_close(weight_gini(wp, mp), weight_gini(w, m))
    torch.testing.assert_close(effective_token_ratio(wp, mp), effective_token_ratio(w, m))
    # padding holding ordinary (non-NaN) values must not leak in either
    wq = torch.cat([w, torch.full((4, extra), 7.0, dtype=torch.float64)], 1)
    torch.testing.assert_close(weight_gini(wq, mp), weight_gini(w, m))


# ---- entropy, quadrants, tail, mass, sign ---------------------------------------------


def test_entropy_stats_match_torch_quantile_and_ignore_padding():
    batch = pad_batch(make_batch(8, 7, 4, seed=5), 3)
    x = batch.entropy[batch.mask].double()
    st_ = entropy_stats(batch.entropy, batch.mask)
    assert set(st_) == {"mean", "std", "p10", "p50", "p90"}
    assert st_["mean"] == pytest.approx(float(x.mean()))
    assert st_["std"] == pytest.approx(float(x.std(unbiased=False)))
    for k, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):
        assert st_[k] == pytest.approx(float(torch.quantile(x, q)))
    empty = entropy_stats(batch.entropy, torch.zeros_like(batch.mask))
    assert all(v == 0.0 for v in empty.values())


def test_quadrant_hand_case():
    # valid surprisals 1..6 -> lower median 3: high = {4, 5, 6}
    s = torch.tensor([[1.0, 4.0, 2.0, 9.0], [5.0, 3.0, 6.0, 0.0]])
    a = torch.tensor([[1.0, 1.0, 0.0, 5.0], [-1.0, -1.0, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]]).bool()
    q = quadrant_fractions(a, s, m)
    # nonzero-A tokens: (1,+,low) (4,+,high) (5,-,high) (3,-,low) (6,+,high)
    assert q == pytest.approx({"pos_high": 2 / 5, "pos_low": 1 / 5, "neg_high": 1 / 5, "neg_low": 1 / 5})


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), extra=st.integers(0, 3))
def test_quadrant_fractions_sum_to_one(seed, extra):
    batch = make_batch(8, 6, 4, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(8, 6, generator=gen) * (torch.rand(8, 6, generator=gen) < 0.8)
    q = quadrant_fractions(a, -batch.logprobs, batch.mask)
    if (batch.mask & (a != 0)).any():
        assert sum(q.values()) == pytest.approx(1.0)
    else:
        assert sum(q.values()) == 0.0
    if extra:
        pb = pad_batch(batch, extra)
        ap = torch.cat([a, torch.full((8, extra), 3.0)], 1)
        assert quadrant_fractions(ap, -pb.logprobs, pb.mask) == q


def test_tail_token_fraction_hand_case():
    alpha = 0.01
    # r = -l - H + log(alpha): tail iff -l - H > log(100) ~ 4.605
    lp = torch.tensor([[-6.0, -1.0, -9.0], [-5.0, -8.0, -30.0]])
    H = torch.tensor([[1.0, 0.1, 5.0], [0.2, 0.5, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    # tails: (-6,1) 5>4.6 yes; (-1) no; (-9,5) 4<4.6 no; (-5,0.2) 4.8 yes; (-8,0.5) yes; last masked
    assert tail_token_fraction(lp, H, m, alpha) == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="alpha"):
        tail_token_fraction(lp, H, m, 0.0)


def test_credit_mass_hand_case():
    a = torch.tensor([[1.0, -2.0, 3.0], [-0.5, 0.0, 100.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    cm = credit_mass(a, m)
    assert cm == pytest.approx({"pos": 4.0, "neg": -2.5, "pos_per_token": 4.0 / 5, "neg_per_token": -2.5 / 5})


def test_sign_agreement():
    a = torch.tensor([[1.0, -1.0, 2.0, 0.0], [-1.0, -1.0, 0.0, 5.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    # row sums 2 and -2: nonzero tokens 1, -1, 2 | -1, -1 -> agreeing 1, 2, -1, -1
    assert sign_agreement(a, m) == pytest.approx(4 / 5)
    # given sequence advantages: row 0 negative, row 1 zero (counts as disagreement)
    assert sign_agreement(a, m, torch.tensor([-1.0, 0.0])) == pytest.approx(1 / 5)
    assert sign_agreement(torch.zeros(2, 4), m) == 1.0
    with pytest.raises(CreditInputError, match="sequence_advantages"):
        sign_agreement(a, m, torch.ones(3))


# ---- the entry point ------------------------------------------------------------------


SPECS = tc.list_methods("estimator") + tc.list_methods("calibrator")


@pytest.mark.parametrize("spec", SPECS)
def test_credit_diagnostics_for_every_method(spec):
    batch = make_batch(8, 6, 4, seed=2, lengths=[3, 0, 6, 2, 1, 5, 4, 6])
    out = CreditPipeline(spec)(batch)
    d = credit_diagnostics(batch, out)
    assert all(k.startswith("diag/") for k in d)
    assert all(math.isfinite(v) for v in d.values()), d
    for k in ("weight_gini", "weight_etr", "credit_pos", "credit_neg", "sign_agreement",
              "quadrant_pos_high", "tail_token_frac", "entropy_mean", "entropy_p50"):
        assert f"diag/{k}" in d
    assert d["diag/weights_from_token_weights"] == (1.0 if out.token_weights is not None else 0.0)
    q = [d[f"diag/quadrant_{k}"] for k in ("pos_high", "pos_low", "neg_high", "neg_low")]
    assert sum(q) == pytest.approx(1.0) or sum(q) == 0.0


def test_credit_diagnostics_uses_abs_advantages_without_weights():
    batch = make_batch(8, 6, 4, seed=4)
    out = CreditPipeline("grpo")(batch)
    d = credit_diagnostics(batch, out)
    assert d["diag/weight_gini"] == pytest.approx(0.0, abs=1e-9)
    assert d["diag/weight_etr"] == pytest.approx(1.0)
    assert d["diag/sign_agreement"] == 1.0
    # a hand-made concentrated credit on one token of each row
    adv = torch.zeros(8, 6)
    adv[:, 0] = torch.where(batch.rewards > 0, 1.0, -1.0)
    d = credit_diagnostics(batch, CreditOutput(advantages=adv))
    n = batch.lengths.double()
    assert d["diag/weight_etr"] == pytest.approx(float((1 / n).mean()))
    # explicit token weights take precedence over |A|
    d = credit_diagnostics(batch, CreditOutput(advantages=adv, token_weights=torch.ones(8, 6)))
    assert d["diag/weight_gini"] == pytest.approx(0.0) and d["diag/weights_from_token_weights"] == 1.0


def test_credit_diagnostics_padding_invariant_and_signal_optional():
    batch = make_batch(8, 6, 4, seed=9)
    out = CreditPipeline("arca")(batch)
    d = credit_diagnostics(batch, out)
    pb = pad_batch(batch, 3)
    pout = CreditPipeline("arca")(pb)
    assert credit_diagnostics(pb, pout) == pytest.approx(d)
    bare = make_batch(8, 6, 4, seed=9, signals=())
    d2 = credit_diagnostics(bare, CreditPipeline("grpo")(bare))
    assert not any(k.startswith(("diag/quadrant", "diag/entropy", "diag/tail")) for k in d2)


def test_credit_diagnostics_bad_shapes():
    batch = make_batch(4, 3, 2)
    with pytest.raises(CreditInputError, match="advantages"):
        credit_diagnostics(batch, CreditOutput(advantages=torch.zeros(4, 2)))
    with pytest.raises(CreditInputError, match="token_weights"):
        credit_diagnostics(batch, CreditOutput(advantages=torch.zeros(4, 3), token_weights=torch.ones(4, 2)))
    with pytest.raises(CreditInputError, match="sequence_advantages"):
        credit_diagnostics(batch, CreditOutput(advantages=torch.zeros(4, 3)), torch.zeros(5))
