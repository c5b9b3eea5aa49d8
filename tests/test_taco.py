"""TACO: tail-aware damping of positive credit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.methods.taco import TACOConfig, taco

from helpers import make_batch, pad_batch


def _batch(logprobs, entropy, mask=None):
    lp = torch.as_tensor(logprobs, dtype=torch.float64)
    if mask is None:
        mask = torch.ones_like(lp, dtype=torch.int64)
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
    # some exact zeros too, which are not positive credit
    a[torch.rand(batch.mask.shape, generator=g) < 0.15] = 0.0
    return a * batch.fmask.to(a.dtype)


def test_hand_case():
    alpha, lam = 0.01, 0.9
    la = math.log(alpha)
    # token 0: r = 10 - 1 + log(.01) = 4.395 > 0 (tail); token 1: r = 2 - 0 + la < 0; token 2: tail
    # but A < 0; token 3: tail with A = 0
    lp = [[-10.0, -2.0, -10.0, -10.0]]
    ent = [[1.0, 0.0, 1.0, 1.0]]
    b = _batch(lp, ent)
    adv = torch.tensor([[2.0, 2.0, -3.0, 0.0]], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(alpha=alpha, lam=lam))
    r0 = 10.0 - 1.0 + la
    w0 = 1 - lam * (1 - math.exp(-r0))
    torch.testing.assert_close(out.advantages, torch.tensor([[2.0 * w0, 2.0, -3.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out.token_weights, torch.tensor([[w0, 1.0, 1.0, 1.0]], dtype=torch.float64))
    r = torch.tensor([r0, 2.0 + la, 9.0 + la, 9.0 + la])
    assert out.metrics["taco/tail_risk_mean"] == pytest.approx(float(r.mean()))
    assert out.metrics["taco/tail_token_frac"] == pytest.approx(3 / 4)
    assert out.metrics["taco/positive_adv_token_frac"] == pytest.approx(2 / 4)
    assert out.metrics["taco/weight_mean"] == pytest.approx((w0 + 1.0) / 2)


def test_tail_distinguishes_rarity_from_exploration():
    # same surprisal (p = 0.001); confident context (H = 0.1) is tail, uncertain one (H = 6) is not
    b = _batch([[math.log(1e-3), math.log(1e-3)]], [[0.1, 6.0]])
    out = taco(b, torch.ones(1, 2, dtype=torch.float64), TACOConfig())
    assert out.token_weights[0, 0] < 1.0 and out.token_weights[0, 1] == 1.0


batch_params = st.tuples(st.integers(1, 3), st.integers(2, 4), st.integers(1, 8), st.integers(0, 10_000))


def _rand_batch(params):
    n_groups, gsize, T, seed = params
    return make_batch(n_groups * gsize, T, gsize, seed=seed, V=50, signals=("logprobs", "entropy"))


@settings(max_examples=30, deadline=None)
@given(params=batch_params, lam=st.floats(0.0, 1.0), alpha=st.floats(1e-4, 0.5))
def test_weights_in_range_and_only_positive_credit_changes(params, lam, alpha):
    b = _rand_batch(params)
    adv = _mixed_adv(b, params[-1])
    out = taco(b, adv, TACOConfig(alpha=alpha, lam=lam))
    w = out.token_weights[b.mask]
    assert (w >= (1 - lam) - 1e-6).all() and (w <= 1.0).all()
    keep = b.mask & (adv <= 0)
    # A <= 0 bitwise untouched
    assert torch.equal(out.advantages[keep], adv[keep])
    assert (out.token_weights[keep] == 1.0).all()
    pos = b.mask & (adv > 0)
    torch.testing.assert_close(out.advantages[pos], (out.token_weights * adv)[pos])


@settings(max_examples=30, deadline=None)
@given(
    lam=st.floats(0.0, 1.0, exclude_max=True),
    lp=st.lists(st.floats(-1e4, 0.0), min_size=1, max_size=6),
    a=st.floats(1e-3, 10.0),
)
# lam so close to 1 that float32 rounds lam * (1 - exp(-r)) to 1: the weight must still be > 0
@example(lam=1 - 1e-9, lp=[-1e4], a=1.0)
def test_never_zeroes_positive_credit_when_lam_below_one(lam, lp, a):
    n = len(lp)
    b = CreditBatch(
        response_mask=torch.ones(1, n, dtype=torch.int64),
        rewards=torch.zeros(1),
        group_ids=torch.zeros(1, dtype=torch.int64),
        logprobs=torch.tensor([lp], dtype=torch.float32),
        entropy=torch.zeros(1, n),
    )
    out = taco(b, torch.full((1, n), a), TACOConfig(lam=lam))
    assert (out.advantages > 0).all()
    # lam = 1 may zero a deep-tail token entirely: the bound is tight
    out1 = taco(b.replace(logprobs=torch.full((1, n), -1e4)), torch.full((1, n), a), TACOConfig(lam=1.0))
    assert (out1.advantages == 0).all()


def test_uniform_when_no_token_is_in_the_tail():
    b = make_batch(8, 6, 4, seed=1, signals=("logprobs", "entropy"))
    adv = _mixed_adv(b, 1)
    # alpha this small puts the tail beyond any sampled token: r = -l - H + log(1e-30) < 0
    out = taco(b, adv, TACOConfig(alpha=1e-30))
    assert out.metrics["taco/tail_token_frac"] == 0.0
    assert torch.equal(out.advantages, adv)
    assert (out.token_weights[b.mask] == 1.0).all()


def test_acts_on_tail_tokens_of_a_real_batch():
    b = make_batch(8, 6, 4, seed=1, V=200, signals=("logprobs", "entropy"))
    adv = torch.ones(8, 6) * b.fmask
    out = taco(b, adv, TACOConfig(alpha=0.5))
    assert out.metrics["taco/tail_token_frac"] > 0
    assert (out.token_weights[b.mask] < 1).any()


@settings(max_examples=30, deadline=None)
@given(params=batch_params)
def test_lam_zero_is_identity(params):
    b = _rand_batch(params)
    adv = _mixed_adv(b, params[-1])
    out = taco(b, adv, TACOConfig(lam=0.0, alpha=0.5))
    assert torch.equal(out.advantages, adv)


def test_prob_reweight_baseline_hand_case():
    b = _batch([[math.log(0.5), math.log(0.02), math.log(0.5)]], [[0.1, 0.1, 0.1]])
    adv = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(mode="prob_reweight", reweight_a=0.1))
    w = torch.tensor([[0.9 + 0.1 * 0.5, 0.9 + 0.1 * 0.02, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(out.token_weights, w)
    torch.testing.assert_close(out.advantages, w * adv)


def test_mask_low_prob_baseline_hand_case():
    # masked: p < 0.002 and H < 1; not masked: p too large, entropy too high, or negative credit
    lp = [[math.log(1e-3), math.log(0.01), math.log(1e-3), math.log(1e-3)]]
    ent = [[0.5, 0.5, 2.0, 0.5]]
    b = _batch(lp, ent)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(mode="mask_low_prob"))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.0, 1.0, 1.0, -1.0]], dtype=torch.float64))
    out = taco(b, adv, TACOConfig(mode="mask_low_prob", mask_entropy=3.0))
    assert out.advantages[0, 2] == 0.0


@pytest.mark.parametrize("mode", ["taco", "prob_reweight", "mask_low_prob"])
def test_finite_masked_and_padding_invariant(mode):
    b = make_batch(8, 6, 4, seed=7, V=200, lengths=[6, 0, 3, 1, 6, 2, 5, 4], signals=("logprobs", "entropy"))
    adv = _mixed_adv(b, 3)
    cfg = TACOConfig(mode=mode, alpha=0.5)
    out = taco(b, adv, cfg)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.token_weights).all()
    assert (out.advantages[~b.mask] == 0).all() and (out.advantages[1] == 0).all()
    pb = pad_batch(b, 3)
    padv = torch.cat([adv, torch.full((8, 3), float("nan"))], dim=1)
    pout = taco(pb, padv, cfg)
    assert torch.equal(pout.advantages[:, :6], out.advantages)
    assert (pout.advantages[:, 6:] == 0).all()
    assert pout.metrics == pytest.approx(out.metrics)


def test_pipeline_and_errors():
    b = make_batch(8, 6, 4, seed=2)
    out = CreditPipeline("taco", taco={"alpha": 0.5})(b)
    assert set(out.metrics) >= {"taco/weight_mean", "taco/tail_risk_mean", "taco/tail_token_frac",
                                "taco/positive_adv_token_frac"}
    for bad, field in [({"alpha": 0.0}, "alpha"), ({"alpha": -1.0}, "alpha"), ({"alpha": math.inf}, "alpha"),
                       ({"lam": 1.1}, "lam"), ({"lam": -0.1}, "lam"), ({"mode": "x"}, "mode"),
                       ({"reweight_a": 2.0}, "reweight_a"), ({"mask_prob": -1.0}, "mask_prob"),
                       ({"mask_entropy": -1.0}, "mask_entropy")]:
        with pytest.raises(ValueError, match=field):
            CreditPipeline("taco", taco=bad)
    with pytest.raises(CreditInputError, match="entropy"):
        CreditPipeline("taco")(b.replace(entropy=None))
    with pytest.raises(CreditInputError, match="logprobs"):
        CreditPipeline("taco")(b.replace(logprobs=None))
    with pytest.raises(CreditInputError, match="advantages"):
        taco(b, torch.zeros(8, 5), TACOConfig())
