"""ACPO (reconstructed): mode-local surrogate entropy, its bounds, its gradient, its weights."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.methods.acpo import ACPOConfig, acpo, entropy_bounds, surrogate_entropy

from helpers import make_batch, pad_batch

LOG2 = math.log(2.0)


def _batch(mode_prob, logprobs, mask=None):
    mp = torch.as_tensor(mode_prob, dtype=torch.float64)
    if mask is None:
        mask = torch.ones_like(mp, dtype=torch.int64)
    B = mp.shape[0]
    return CreditBatch(
        response_mask=torch.as_tensor(mask),
        rewards=torch.zeros(B, dtype=torch.float64),
        group_ids=torch.zeros(B, dtype=torch.int64),
        logprobs=torch.as_tensor(logprobs, dtype=torch.float64),
        mode_prob=mp,
    )


def _hb(p):
    return 0.0 if p in (0.0, 1.0) else -p * math.log(p) - (1 - p) * math.log(1 - p)


# ---- the surrogate and its bounds ------------------------------------------------------


def test_surrogate_values():
    p = torch.tensor([0.0, 0.5, 1.0, 0.9], dtype=torch.float64)
    torch.testing.assert_close(surrogate_entropy(p), torch.tensor([0.0, LOG2, 0.0, _hb(0.9)], dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(V=st.integers(2, 300), temperature=st.floats(0.05, 5.0), seed=st.integers(0, 10_000),
       scale=st.floats(0.1, 10.0))
def test_true_entropy_lies_within_the_bounds(V, temperature, seed, scale):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, V, generator=g, dtype=torch.float64) * scale
    probs = torch.softmax(logits / temperature, -1)
    H = -torch.special.xlogy(probs, probs).sum(-1)
    lo, hi = entropy_bounds(probs.max(-1).values, V)
    assert (lo <= H + 1e-9).all() and (H <= hi + 1e-9).all()
    if V == 2:  # mode-vs-rest is the whole distribution: the bounds meet
        torch.testing.assert_close(lo, H)
        torch.testing.assert_close(hi, H)


def test_bounds_are_attained():
    # lower: all the rest on one token; upper: the rest spread uniformly
    V, p = 5, 0.6
    lo_case = torch.tensor([p, 1 - p, 0.0, 0.0, 0.0], dtype=torch.float64)
    hi_case = torch.tensor([p] + [(1 - p) / (V - 1)] * (V - 1), dtype=torch.float64)
    lo, hi = entropy_bounds(torch.tensor(p, dtype=torch.float64), V)
    for dist, bound in ((lo_case, lo), (hi_case, hi)):
        torch.testing.assert_close(-torch.special.xlogy(dist, dist).sum(), bound)
    with pytest.raises(ValueError, match="vocab_size"):
        entropy_bounds(torch.tensor(0.5), 1)


def _cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


@settings(max_examples=30, deadline=None)
@given(V=st.integers(2, 40), temperature=st.floats(0.2, 3.0), seed=st.integers(0, 10_000))
def test_surrogate_gradient_is_parallel_to_the_policy_gradient_under_modal_alignment(V, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(V, generator=g, dtype=torch.float64) / temperature).requires_grad_(True)
    logpi = torch.log_softmax(z, -1)
    y = int(logpi.argmax())  # the sampled token is the mode
    p = logpi[y].exp()
    pv = p.item()
    if abs(pv - 0.5) < 1e-3 or pv > 1 - 1e-9:
        return  # Hs'(p) = 0 at p = 1/2 and the gradients vanish as p -> 1: no direction to compare
    (g_hs,) = torch.autograd.grad(surrogate_entropy(p), z, retain_graph=True)
    (g_lp,) = torch.autograd.grad(logpi[y], z)
    c = _cos(g_hs, g_lp)
    assert abs(abs(c) - 1.0) < 1e-9, c
    # the sign is that of Hs'(p) = log((1 - p) / p): raising a confident mode lowers Hs
    assert (c > 0) == (pv < 0.5)


def test_full_entropy_and_non_mode_tokens_break_the_alignment():
    # what modal alignment buys: grad of the true entropy, or of Hs when y is not the mode,
    # is not parallel to grad log pi(y)
    z = torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    logpi = torch.log_softmax(z, -1)
    probs = logpi.exp()
    (g_lp0,) = torch.autograd.grad(logpi[0], z, retain_graph=True)
    (g_h,) = torch.autograd.grad(-(probs * logpi).sum(), z, retain_graph=True)
    assert abs(abs(_cos(g_h, g_lp0)) - 1.0) > 1e-3
    (g_lp2,) = torch.autograd.grad(logpi[2], z, retain_graph=True)
    (g_hs,) = torch.autograd.grad(surrogate_entropy(probs.max()), z)
    assert abs(abs(_cos(g_hs, g_lp2)) - 1.0) > 1e-3


# ---- the credit weights ----------------------------------------------------------------


def test_hand_case():
    # row 0 (A > 0): u from mode probs; row 1 (A < 0): c = pi(y) on mode tokens, 0 elsewhere
    mp = [[0.5, 0.9, 1.0], [0.8, 0.6, 0.7]]
    lp = [[math.log(0.5), math.log(0.05), 0.0], [math.log(0.8), math.log(0.3), math.log(0.7) - 5e-4]]
    b = _batch(mp, lp)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    cfg = ACPOConfig(beta_pos=0.5, beta_neg=0.8, w_min=0.0, w_max=10.0)
    out = acpo(b, adv, cfg)
    u = [_hb(0.5) / LOG2, _hb(0.9) / LOG2, 0.0]
    c = [0.8, 0.0, 0.7 * math.exp(-5e-4)]  # token 2 is the mode within mode_tol = 1e-3
    w0 = [1 + 0.5 * (x - sum(u) / 3) for x in u]
    w1 = [1 + 0.8 * (x - sum(c) / 3) for x in c]
    w = torch.tensor([w0, w1], dtype=torch.float64)
    torch.testing.assert_close(out.token_weights, w)
    torch.testing.assert_close(out.advantages, w * adv)
    assert out.metrics["acpo/mode_token_frac"] == pytest.approx(4 / 6)
    assert out.metrics["acpo/clip_frac"] == 0.0
    # uncertain step of a success and overconfident step of a failure are emphasised
    assert int(out.token_weights[0].argmax()) == 0 and int(out.token_weights[1].argmax()) == 0
    # a tighter tolerance makes token 2 a non-mode token (c = 0)
    out = acpo(b, adv, ACPOConfig(beta_pos=0.5, beta_neg=0.8, w_min=0.0, w_max=10.0, mode_tol=1e-4))
    w1 = [1 + 0.8 * (x - 0.8 / 3) for x in (0.8, 0.0, 0.0)]
    torch.testing.assert_close(out.token_weights[1], torch.tensor(w1, dtype=torch.float64))


batch_params = st.tuples(st.integers(1, 3), st.integers(2, 4), st.integers(1, 9), st.integers(0, 10_000))


@settings(max_examples=30, deadline=None)
@given(params=batch_params, beta_pos=st.floats(0.0, 1.0), beta_neg=st.floats(0.0, 1.0))
def test_mean_preserving_within_a_trajectory_when_no_clip_binds(params, beta_pos, beta_neg):
    n_groups, gsize, T, seed = params
    b = make_batch(n_groups * gsize, T, gsize, seed=seed, dtype=torch.float64, signals=("logprobs", "mode_prob"))
    adv = CreditPipeline("grpo")(b).advantages  # one sign per trajectory
    # |u - mean u|, |c - mean c| <= 1 and beta <= 1 keep w in [0, 2]: no clip binds
    cfg = ACPOConfig(beta_pos=beta_pos, beta_neg=beta_neg, w_min=0.0, w_max=2.0)
    out = acpo(b, adv, cfg)
    assert out.metrics["acpo/clip_frac"] == 0.0
    live = b.mask.any(1) & (adv != 0).any(1)
    w = out.token_weights
    means = (w * b.fmask).sum(1) / b.fmask.sum(1).clamp_min(1)
    torch.testing.assert_close(means[live], torch.ones_like(means[live]))
    # so each trajectory's total credit is the estimator's
    torch.testing.assert_close(out.advantages.sum(1), adv.sum(1))


def test_clipping_bounds_the_weights():
    b = make_batch(8, 6, 4, seed=3, signals=("logprobs", "mode_prob"))
    adv = CreditPipeline("grpo")(b).advantages
    out = acpo(b, adv, ACPOConfig(beta_pos=20.0, beta_neg=20.0, w_min=0.3, w_max=1.7))
    w = out.token_weights[b.mask & (adv != 0)]
    assert (w >= 0.3).all() and (w <= 1.7).all()
    assert out.metrics["acpo/clip_frac"] > 0


def test_zero_credit_tokens_are_untouched():
    b = make_batch(8, 6, 4, seed=5, signals=("logprobs", "mode_prob"))
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(8, 6, generator=g)
    adv[torch.rand(8, 6, generator=g) < 0.4] = 0.0
    adv = adv * b.fmask
    out = acpo(b, adv, ACPOConfig())
    zero = b.mask & (adv == 0)
    assert zero.any()
    assert (out.advantages[zero] == 0).all() and (out.token_weights[zero] == 1.0).all()
    # the sign of credit never flips (w > 0)
    assert ((out.advantages * adv)[b.mask & (adv != 0)] > 0).all()


def test_finite_masked_and_padding_invariant():
    b = make_batch(8, 6, 4, seed=9, lengths=[6, 0, 3, 1, 6, 2, 5, 4], signals=("logprobs", "mode_prob"))
    adv = CreditPipeline("grpo")(b).advantages
    out = acpo(b, adv, ACPOConfig())
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.token_weights).all()
    assert (out.advantages[~b.mask] == 0).all() and (out.advantages[1] == 0).all()
    pout = acpo(pad_batch(b, 3), torch.cat([adv, torch.full((8, 3), float("nan"))], 1), ACPOConfig())
    torch.testing.assert_close(pout.advantages[:, :6], out.advantages)
    assert (pout.advantages[:, 6:] == 0).all()
    # degenerate mode probabilities (0 and 1) stay finite
    d = _batch([[0.0, 1.0, 1.0]], [[-3.0, 0.0, -1.0]])
    o = acpo(d, torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64), ACPOConfig())
    assert torch.isfinite(o.advantages).all()


@pytest.mark.parametrize("bad,field", [
    ({"beta_pos": -1.0}, "beta_pos"), ({"beta_neg": math.nan}, "beta_neg"), ({"w_min": 1.5}, "w_min"),
    ({"w_min": -0.1}, "w_min"), ({"w_max": 0.5}, "w_max"), ({"mode_tol": -1.0}, "mode_tol"),
])
def test_config_errors(bad, field):
    with pytest.raises(ValueError, match=field):
        CreditPipeline("acpo", acpo=bad)


def test_input_errors():
    b = make_batch(8, 6, 4, seed=2)
    with pytest.raises(CreditInputError, match="mode_prob"):
        CreditPipeline("acpo")(b.replace(mode_prob=None))
    with pytest.raises(CreditInputError, match="logprobs"):
        CreditPipeline("acpo")(b.replace(logprobs=None))
    with pytest.raises(CreditInputError, match="advantages"):
        acpo(b, torch.zeros(8, 7), ACPOConfig())
