"""ACPO (reconstructed): mode-local surrogate entropy, its bounds, its gradient, its weights."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.acpo import ACPOConfig, acpo, entropy_bounds, surrogate_entropy

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
    ({"branch": "outcome"}, "branch"),
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


# ---- acpo() itself: direction of the reweighting, its sign, its surrogate -----------------


def _real_batch(seed, B=6, T=7, V=13, mode_rows=()):
    """Signals from real next-token distributions (logits requiring grad), with the sampled
    token forced to the mode in ``mode_rows`` and to a non-mode token at odd positions elsewhere."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2.0).requires_grad_(True)
    logpi = torch.log_softmax(z, -1)
    probs = logpi.detach().exp()
    mode = probs.argmax(-1)
    y = torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(B, T)
    for b in range(B):
        for t in range(T):
            if b in mode_rows or t % 2 == 0:
                y[b, t] = mode[b, t]
            elif y[b, t] == mode[b, t]:
                y[b, t] = (mode[b, t] + 1) % V
    lp = logpi.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    batch = CreditBatch(
        response_mask=torch.ones(B, T, dtype=torch.int64),
        rewards=torch.zeros(B, dtype=torch.float64),
        group_ids=torch.zeros(B, dtype=torch.int64),
        logprobs=lp,  # attached to z: acpo must not differentiate through its signals
        mode_prob=logpi.exp().max(-1).values,
        entropy=-(probs * probs.log()).sum(-1),
    )
    return batch, z, lp, probs, y == mode


def _u(probs):
    p = probs.max(-1).values
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(1 - p, 1 - p)) / LOG2


def test_positive_credit_rises_with_the_surrogate_uncertainty_and_averages_one():
    """A > 0 rows: w - 1 = beta_pos (u - mean_traj u), u the binary mode-vs-rest entropy.

    Fails if: beta_pos and beta_neg are swapped; u is taken from the sampled token's probability
    or from the full entropy; the weights are not centred, or centred over the batch; the
    confidence weights are applied to A > 0."""
    batch, _, _, probs, _ = _real_batch(0)
    adv = torch.tensor([1.0, 2.0, 0.5, -1.0, -1.0, -1.0], dtype=torch.float64).unsqueeze(1).expand(6, 7).clone()
    cfg = ACPOConfig(beta_pos=0.7, beta_neg=0.3, w_min=0.0, w_max=10.0)
    out = acpo(batch, adv, cfg)
    u = _u(probs)
    w = out.token_weights[:3]
    torch.testing.assert_close(w - 1.0, 0.7 * (u[:3] - u[:3].mean(1, keepdim=True)))
    torch.testing.assert_close(w.mean(1), torch.ones(3, dtype=torch.float64))
    # within each successful trajectory the weight is increasing in u: the most uncertain
    # decision gets the most credit, the most confident the least
    for b in range(3):
        order = u[b].argsort()
        assert (w[b][order].diff() > 0).all()
    torch.testing.assert_close(out.advantages[:3], w * adv[:3])


def test_negative_credit_rises_with_the_confidence_of_mode_tokens():
    """A < 0 rows: w - 1 = beta_neg (c - mean_traj c), c = pi(y) where y is the mode, else 0.

    Fails if: beta_pos and beta_neg are swapped; c ignores the mode test (exp(l) everywhere) or
    uses the mode probability on non-mode tokens; no centring; the uncertainty weights are
    applied to A < 0."""
    batch, _, _, probs, is_mode = _real_batch(1, mode_rows=(5,))
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -3.0, -0.5], dtype=torch.float64).unsqueeze(1).expand(6, 7).clone()
    cfg = ACPOConfig(beta_pos=0.3, beta_neg=0.7, w_min=0.0, w_max=10.0)
    out = acpo(batch, adv, cfg)
    c = torch.where(is_mode, batch.logprobs.detach().exp(), torch.zeros(()).double())
    w = out.token_weights[3:]
    torch.testing.assert_close(w - 1.0, 0.7 * (c[3:] - c[3:].mean(1, keepdim=True)))
    torch.testing.assert_close(w.mean(1), torch.ones(3, dtype=torch.float64))
    # in failed trajectories with non-mode tokens, every sampled mode token (a confident
    # choice) gets more blame than every non-mode token
    for b in (3, 4):
        m = is_mode[b]
        assert m.any() and (~m).any()
        assert w[b - 3][m].min() > w[b - 3][~m].max()
    # row 5 samples the mode everywhere: blame follows the confidence pi(y) = p
    order = c[5].argsort()
    assert (w[2][order].diff() > 0).all()
    torch.testing.assert_close(out.advantages[3:], w * adv[3:])


def test_mixed_sign_trajectory_uses_each_signs_signal_and_never_flips_a_sign():
    """An estimator with per-token signs (OPPO-like): A > 0 tokens get u-weights, A < 0 tokens
    c-weights, both centred on the trajectory; with the default clip no sign ever flips."""
    batch, _, _, probs, is_mode = _real_batch(2)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(6, 7, generator=g, dtype=torch.float64)
    adv[adv.abs() < 0.2] = 0.0
    cfg = ACPOConfig(beta_pos=0.6, beta_neg=0.9, w_min=0.0, w_max=10.0, branch="token")
    out = acpo(batch, adv, cfg)
    u = _u(probs)
    c = torch.where(is_mode, batch.logprobs.detach().exp(), torch.zeros(()).double())
    want = torch.where(adv > 0, 1 + 0.6 * (u - u.mean(1, keepdim=True)),
                       torch.where(adv < 0, 1 + 0.9 * (c - c.mean(1, keepdim=True)), torch.ones_like(u)))
    torch.testing.assert_close(out.token_weights, want)
    # defaults, and betas large enough that the clip binds: w >= w_min > 0, signs preserved
    for cfg in (ACPOConfig(), ACPOConfig(beta_pos=50.0, beta_neg=50.0), ACPOConfig(branch="token"),
                ACPOConfig(beta_pos=50.0, beta_neg=50.0, branch="token")):
        o = acpo(batch, adv, cfg)
        nz = adv != 0
        assert (o.advantages[nz] * adv[nz] > 0).all()
        assert (o.advantages[~nz] == 0).all()


def test_each_tokens_policy_gradient_is_rescaled_not_rotated():
    """The direction claim on acpo()'s output: with the signals computed from the policy's own
    logits (attached to the graph), the gradient of the ACPO-weighted policy-gradient loss at
    each token is w_t times the unweighted one: same direction (cosine +1), scaled by w_t > 0.

    Fails if acpo differentiates through mode_prob or logprobs (the weight's own gradient is
    not parallel to grad log pi(y) at a non-mode token) or if a weight is <= 0."""
    batch, z, lp, _, is_mode = _real_batch(4)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64).unsqueeze(1).expand(6, 7).clone()
    out = acpo(batch, adv, ACPOConfig())
    assert not out.advantages.requires_grad
    w = out.token_weights
    for b, t in [(0, 1), (0, 2), (2, 3), (3, 0), (4, 1), (5, 4)]:
        (g_w,) = torch.autograd.grad(-(out.advantages[b, t] * lp[b, t]), z, retain_graph=True)
        (g_1,) = torch.autograd.grad(-(adv[b, t] * lp[b, t]), z, retain_graph=True)
        g_w, g_1 = g_w.flatten(), g_1.flatten()
        assert _cos(g_w, g_1) == pytest.approx(1.0, abs=1e-12), (b, t, bool(is_mode[b, t]))
        torch.testing.assert_close(g_w.norm() / g_1.norm(), w[b, t])


def test_the_surrogate_acpo_uses_is_within_the_true_entropy_bounds():
    """acpo's surrogate (its metric, and the u its weights follow) lies between the bounds of
    the true entropy of the distributions the signals came from; at V = 2 it is the entropy."""
    for V in (2, 13):
        batch, _, _, probs, _ = _real_batch(5, V=V)
        H = batch.entropy
        lo, hi = entropy_bounds(probs.max(-1).values, V)
        hs = acpo(batch, torch.ones(6, 7, dtype=torch.float64), ACPOConfig()).metrics["acpo/surrogate_entropy_mean"]
        assert lo.mean().item() == pytest.approx(hs)
        assert hs <= H.mean().item() + 1e-12 <= hi.mean().item() + 1e-12
        # beta_pos = 1, no clip: weight differences are exactly the differences of Hs / log 2
        out = acpo(batch, torch.ones(6, 7, dtype=torch.float64), ACPOConfig(beta_pos=1.0, w_min=0.0, w_max=10.0))
        d = out.token_weights - out.token_weights[:, :1]
        torch.testing.assert_close(d, (lo - lo[:, :1]) / LOG2)
        if V == 2:
            torch.testing.assert_close(d, (H - H[:, :1]) / LOG2)


def test_branch_is_the_rollouts_outcome_not_each_tokens_sign():
    """The abstract's "successful rollouts" / "failed rollouts": every token of a rollout whose
    credit sums above 0 follows the uncertainty branch, whatever its own sign; below 0 the
    confidence branch. Under GRPO (one sign per rollout) the two readings agree; after OPPO
    without anchoring (per-token signs) they differ, and only on the tokens against the outcome."""
    batch, _, _, probs, is_mode = _real_batch(2)
    u = _u(probs)
    c = torch.where(is_mode, batch.logprobs.detach().exp(), torch.zeros(()).double())
    w_pos = 1 + 0.6 * (u - u.mean(1, keepdim=True))
    w_neg = 1 + 0.9 * (c - c.mean(1, keepdim=True))
    kw = dict(beta_pos=0.6, beta_neg=0.9, w_min=0.0, w_max=10.0)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(6, 7, generator=g, dtype=torch.float64)
    adv[2] = adv[2].abs() * 0.0  # a rollout with no credit: untouched
    out = acpo(batch, adv, ACPOConfig(**kw))
    d = torch.sign(adv.sum(1, keepdim=True))
    want = torch.where(adv == 0, torch.ones_like(u), torch.where(d > 0, w_pos, torch.where(d < 0, w_neg, torch.ones_like(u))))
    torch.testing.assert_close(out.token_weights, want)
    tok = acpo(batch, adv, ACPOConfig(branch="token", **kw))
    against = (torch.sign(adv) != d) & (adv != 0)
    assert against.any()
    assert (out.token_weights[against] != tok.token_weights[against]).all()
    torch.testing.assert_close(out.token_weights[~against], tok.token_weights[~against])
    # GRPO credit (one sign per rollout): the two branches give the same credit
    grpo = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64).unsqueeze(1).expand(6, 7).clone()
    torch.testing.assert_close(acpo(batch, grpo, ACPOConfig(**kw)).advantages,
                               acpo(batch, grpo, ACPOConfig(branch="token", **kw)).advantages)
