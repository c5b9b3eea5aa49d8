"""ARCA and the weighting it shares with its intrinsic baselines (surprisal, entropy, divergence).

Baseline-specific tests (the entropy-reduction salience, the scores against the authors' code)
are in tests/test_intrinsic.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokencredit as tc
from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.losses import PPOLossConfig, ppo_loss
from tokencredit.credit.methods.arca import ARCAConfig, normalize_salience
from tokencredit.credit.methods.intrinsic import (
    DivergenceConfig,
    EntropyConfig,
    SurprisalConfig,
    entropy_reduction,
)

from helpers import make_batch, pad_batch

SALIENCE_METHODS = ["arca", "surprisal", "entropy", "divergence"]


def salience_of(name, batch):
    return {
        "arca": lambda: batch.hidden_residual,
        "surprisal": lambda: -batch.logprobs,
        "entropy": lambda: entropy_reduction(batch.entropy, batch.mask),
        "divergence": lambda: (batch.logprobs - batch.ref_logprobs).abs(),
    }[name]()


def _grpo(batch):
    return CreditPipeline("grpo")(batch).advantages


def _valid_means(w, mask):
    return (w * mask).sum(1) / mask.sum(1).clamp_min(1)


def reference_weights(scores, mask, eps=1e-8, sharpening=1.0):
    """The authors' weights, written from rodlaf/tokenweighting ``build_token_weights``:
    ``(score + eps) ** sharpening``, clamped at 0, masked, divided by the row sum floored at eps.
    Sum 1 per trajectory."""
    s = scores.double() + eps
    if sharpening != 1.0:
        s = s.pow(sharpening)
    s = torch.where(mask.bool(), s.clamp(min=0.0), torch.zeros_like(s))  # NaN padding stays out
    return s / s.sum(-1, keepdim=True).clamp_min(eps)


# ---- normalize_salience --------------------------------------------------------------


def test_hand_case_and_kappa_mixing():
    s = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    w = normalize_salience(s, m, eps=0.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 1.5, 0.0], [4.0, 0.0, 0.0, 0.0]]))
    w = normalize_salience(s, m, eps=0.0, kappa=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.75, 1.0, 1.25, 0.0], [2.5, 0.5, 0.5, 0.5]]))
    # clipping (an option, off by default): the one-hot row is capped at w_max
    w = normalize_salience(s, m, eps=0.0, w_max=2.0)
    torch.testing.assert_close(w[1], torch.tensor([2.0, 0.0, 0.0, 0.0]))
    assert normalize_salience(s, m, kappa=0.0, w_max=2.0)[0, :3].tolist() == [1.0, 1.0, 1.0]


def test_eps_floor_is_added_to_every_score():
    # (s + eps) / sum(s + eps) * n with eps = 1e-8: [1, 1, 4] / 6 * 3; without the floor [0, 0, 3]
    s = torch.tensor([[0.0, 0.0, 3e-8]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.bool)
    w = normalize_salience(s, m)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 2.0]], dtype=torch.float64))
    torch.testing.assert_close(normalize_salience(s, m, eps=0.0), torch.tensor([[0.0, 0.0, 3.0]], dtype=torch.float64))
    # scores far above eps: the floor is invisible
    big = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(normalize_salience(big, torch.ones(1, 2, dtype=torch.bool)),
                               torch.tensor([[0.5, 1.5]], dtype=torch.float64), rtol=1e-7, atol=1e-7)


def test_sharpening_power_two_hand_case():
    # n (s + eps)^2 / sum (s + eps)^2: [1, 4, 9] / 14 * 3 on the valid tokens, padding 0
    s = torch.tensor([[1.0, 2.0, 3.0, float("nan")]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0]]).bool()
    w = normalize_salience(s, m, sharpening=2.0)
    torch.testing.assert_close(w, torch.tensor([[3 / 14, 12 / 14, 27 / 14, 0.0]], dtype=torch.float64))
    # the same as the reference's sum-1 weights times n, for any power
    gen = torch.Generator().manual_seed(4)
    s = torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3
    m = torch.rand(5, 7, generator=gen) < 0.8
    for p in (0.5, 1.0, 2.0, 3.0):
        ref = reference_weights(s, m, sharpening=p) * m.sum(1, keepdim=True)
        torch.testing.assert_close(normalize_salience(s, m, sharpening=p), ref)
    # power 0: uniform credit
    assert normalize_salience(s, m, sharpening=0.0)[m].eq(1.0).all()


def test_all_zero_salience_row_is_uniform_not_nan():
    s = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [float("nan")] * 3])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]]).bool()
    for kw in ({}, {"kappa": 0.3, "w_max": 5.0}, {"eps": 0.0}, {"sharpening": 2.0}, {"eps": 0.0, "sharpening": 3.0}):
        w = normalize_salience(s, m, **kw)
        assert torch.isfinite(w).all()
        assert w[0].tolist() == [1.0, 1.0, 1.0]
        assert w[2].tolist() == [0.0, 0.0, 0.0]  # empty row: zeros


def test_vanishing_scores_with_sharpening_stay_uniform_and_finite():
    # Deliberate deviation from the authors' code (docs/methods.md): their row sum is floored at
    # eps, a no-op at sharpening 1 (each term is >= eps) but not above it: an all-zero residual
    # (a fresh LoRA) at sharpening 2 gets weights eps^2 / eps = 1e-8 per token there (sum n * 1e-8,
    # not 1). Here the weights stay the paper's sum-1 weights: uniform.
    z = torch.zeros(2, 100, dtype=torch.float64)
    m = torch.ones(2, 100, dtype=torch.bool)
    assert reference_weights(z, m, sharpening=2.0).sum(1).tolist() == pytest.approx([1e-6, 1e-6])
    assert reference_weights(z, m, sharpening=1.0).sum(1).tolist() == pytest.approx([1.0, 1.0])
    assert normalize_salience(z, m, sharpening=2.0).eq(1.0).all()
    # a large power on tiny float32 scores: (1e-8)^10 underflows, the ratios do not
    s = torch.tensor([[0.0, 0.0, 0.0], [1e-3, 2e-3, 0.0]])
    w = normalize_salience(s, torch.ones(2, 3, dtype=torch.bool), sharpening=10.0)
    assert torch.isfinite(w).all()
    assert w[0].tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(w[1], torch.tensor([3 / 1025, 3 * 1024 / 1025, 0.0]))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), kappa=st.floats(0.0, 1.0), scale=st.floats(1e-6, 1e6),
       sharpening=st.sampled_from([0.5, 1.0, 2.0]))
def test_mean_one_per_trajectory_and_scale_free(seed, kappa, scale, sharpening):
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(5, 7, generator=gen, dtype=torch.float64) * (torch.rand(5, 7, generator=gen) < 0.8)
    m = torch.rand(5, 7, generator=gen) < 0.8
    kw = {"kappa": kappa, "sharpening": sharpening}
    w = normalize_salience(s, m, **kw)
    rows = m.any(1)
    torch.testing.assert_close(_valid_means(w, m)[rows], torch.ones(int(rows.sum()), dtype=torch.float64))
    # without the eps floor only within-trajectory ratios matter: rescaling changes nothing
    w0 = normalize_salience(s, m, eps=0.0, **kw)
    torch.testing.assert_close(normalize_salience(s * scale, m, eps=0.0, **kw), w0)
    # and one row's salience never moves another row's weights
    s2 = s.clone()
    s2[0] = s2[0] * 3 + 1
    torch.testing.assert_close(normalize_salience(s2, m, **kw)[1:], w[1:])


def test_clipped_weights_stay_in_range():
    gen = torch.Generator().manual_seed(0)
    s = torch.rand(6, 40, generator=gen) ** 8  # heavy-tailed: some ratios far above w_max
    m = torch.ones(6, 40, dtype=torch.bool)
    w = normalize_salience(s, m, w_max=3.0)
    assert (w >= 0).all() and (w <= 3.0).all() and (w == 3.0).any()


def test_normalize_salience_errors():
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(CreditInputError, match="salience.*>= 0"):
        normalize_salience(torch.tensor([[1.0, -0.1, 1.0], [1.0, 1.0, 1.0]]), m)
    with pytest.raises(CreditInputError, match="salience.*finite"):
        normalize_salience(torch.tensor([[1.0, float("inf"), 1.0], [1.0, 1.0, 1.0]]), m)
    with pytest.raises(CreditInputError, match="salience.*shape"):
        normalize_salience(torch.ones(2, 4), m)
    with pytest.raises(ValueError, match="kappa"):
        normalize_salience(torch.ones(2, 3), m, kappa=1.5)
    with pytest.raises(ValueError, match="w_max"):
        normalize_salience(torch.ones(2, 3), m, w_max=0.5)
    with pytest.raises(ValueError, match="eps"):
        normalize_salience(torch.ones(2, 3), m, eps=-1e-8)
    with pytest.raises(ValueError, match="sharpening"):
        normalize_salience(torch.ones(2, 3), m, sharpening=-1.0)


# ---- the calibrators -------------------------------------------------------------------


@pytest.mark.parametrize("name", SALIENCE_METHODS)
def test_weights_are_normalize_salience_of_the_signal(name):
    batch = make_batch(8, 7, 4, seed=3, lengths=[7, 1, 4, 0, 5, 6, 2, 3])
    cfg = {"kappa": 0.7, "w_max": 2.5, "sharpening": 2.0, "eps": 1e-3}
    out = CreditPipeline(name, **{name: cfg})(batch)
    expected = normalize_salience(salience_of(name, batch), batch.mask, **cfg)
    torch.testing.assert_close(out.token_weights, expected)
    # A' = w A on every token, positive and negative advantages alike
    a = _grpo(batch)
    assert (a > 0).any() and (a < 0).any()
    torch.testing.assert_close(out.advantages, expected * a)
    assert (out.advantages[3] == 0).all() and (out.token_weights[3] == 0).all()
    info = tc.get_method(name)
    assert info.kind == "calibrator" and info.paired_with == "grpo"


def test_requirements_and_provenance():
    assert tc.get_method("arca").requires == {"hidden_residual"}
    assert tc.get_method("surprisal").requires == {"logprobs"}
    assert tc.get_method("entropy").requires == {"entropy"}
    assert tc.get_method("divergence").requires == {"logprobs", "ref_logprobs"}
    for n in SALIENCE_METHODS:
        # all four scores are in the authors' code (rodlaf/tokenweighting token_weights.py)
        assert tc.get_method(n).provenance == "ref-code"
        # the paper's estimator is length-normalised per trajectory: a trainer's default
        assert tc.get_method(n).loss_defaults == {"agg_mode": "seq-mean-token-mean"}


@pytest.mark.parametrize("cls", [ARCAConfig, SurprisalConfig, EntropyConfig, DivergenceConfig])
def test_defaults_are_the_reference_code(cls):
    # TokenWeightingConfig: eps 1e-8, sharpening 1.0; no mixing and no clipping
    cfg = cls()
    assert (cfg.eps, cfg.sharpening, cfg.kappa, cfg.w_max) == (1e-8, 1.0, 1.0, math.inf)


def heavy_tailed_batch(dtype=torch.float64):
    """One group of four with unequal lengths; row 0's residual has one token at 10 / 1.75 = 5.7x
    the mean of its 6 tokens (above the 5x clip tokencredit used to apply by default)."""
    batch = make_batch(4, 6, 4, seed=5, lengths=[6, 3, 5, 2], dtype=dtype)
    res = batch.hidden_residual.clone()
    res[0] = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 10.0], dtype=dtype)
    return batch.replace(hidden_residual=res)


def test_heavy_tailed_residual_gets_the_reference_weights_unclipped():
    batch = heavy_tailed_batch()
    out = CreditPipeline("arca")(batch)
    n = batch.mask.sum(1, keepdim=True)
    expected = reference_weights(batch.hidden_residual, batch.mask) * n
    assert expected[0, 5] > 5.0  # the reference gives this token more than 5x the mean credit
    torch.testing.assert_close(out.token_weights, expected.to(out.token_weights.dtype))
    torch.testing.assert_close(out.advantages, expected * _grpo(batch))


@pytest.mark.parametrize("sharpening", [1.0, 2.0])
def test_gradient_equals_the_reference_loss_under_seq_mean_token_mean(sharpening):
    """tokencredit's mean-1 weights with seq-mean-token-mean give the gradient of the authors'
    loss ``-mean_b(A_b sum_t w_t log pi_t)`` (sum-1 weights; run_experiment.compute_loss);
    token-mean does not (it weights each trajectory by its length)."""
    batch = heavy_tailed_batch()
    mask = batch.mask
    lp = batch.logprobs.clone().requires_grad_(True)
    A = _grpo(batch)[:, 0]  # the trajectory advantage (every row has a first valid token)
    w_ref = reference_weights(batch.hidden_residual, mask, sharpening=sharpening)
    loss_ref = -(A * (w_ref * lp * mask).sum(-1)).mean()
    (g_ref,) = torch.autograd.grad(loss_ref, lp)

    adv = CreditPipeline("arca", arca={"sharpening": sharpening})(batch).advantages
    grads = {}
    for agg in ("seq-mean-token-mean", "token-mean"):
        # on-policy (ratio 1, one epoch): the PPO gradient is -A' grad log pi, aggregated
        loss, _ = ppo_loss(lp, lp.detach(), adv, batch.response_mask, PPOLossConfig(agg_mode=agg))
        (grads[agg],) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grads["seq-mean-token-mean"], g_ref)
    assert not torch.allclose(grads["token-mean"], g_ref, rtol=1e-3, atol=1e-6)


def test_arca_zero_residual_trajectory_gets_uniform_credit():
    batch = make_batch(8, 6, 4, seed=1, lengths=[6, 3, 5, 2, 6, 4, 1, 5])
    res = batch.hidden_residual.clone()
    res[2] = 0.0  # a fresh LoRA for this trajectory
    batch = batch.replace(hidden_residual=res)
    out = CreditPipeline("arca")(batch)
    a = _grpo(batch)
    assert torch.isfinite(out.advantages).all()
    torch.testing.assert_close(out.advantages[2], a[2])
    assert out.token_weights[2, :5].tolist() == [1.0] * 5
    assert out.metrics["arca/zero_residual_frac"] == pytest.approx(1 / 8)
    # everything zero (B = 0 at initialisation): plain GRPO credit and uniform diagnostics
    fresh = batch.replace(hidden_residual=torch.zeros(8, 6))
    out = CreditPipeline("arca")(fresh)
    torch.testing.assert_close(out.advantages, _grpo(fresh))
    assert out.metrics["arca/zero_residual_frac"] == 1.0
    assert out.metrics["arca/gini"] == 0.0 and out.metrics["arca/etr"] == 1.0
    assert out.metrics["arca/weight_max_mean"] == 1.0


def test_arca_preserves_trajectory_credit_when_no_clip_binds():
    batch = make_batch(8, 6, 4, seed=6)
    out = CreditPipeline("arca", arca={"kappa": 0.6, "w_max": math.inf})(batch)
    a = _grpo(batch)
    torch.testing.assert_close(out.advantages.sum(1), a.sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_valid_means(out.token_weights, batch.fmask), torch.ones(8))


def test_arca_metrics_hand_case():
    # one group of two; residuals [1, 3] and a one-hot row [0, 2]
    batch = CreditBatch(
        response_mask=torch.ones(2, 2), rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
        hidden_residual=torch.tensor([[1.0, 3.0], [0.0, 2.0]]),
    )
    out = CreditPipeline("arca")(batch)
    torch.testing.assert_close(out.token_weights, torch.tensor([[0.5, 1.5], [0.0, 2.0]]))
    # Gini: row 0 = 1 / (2 * 4 * 1) * 2 = 0.25, row 1 = (n - 1) / n = 0.5
    assert out.metrics["arca/gini"] == pytest.approx(0.375)
    # ETR: row 0 = 4 / (2 * 2.5) = 0.8, row 1 = 1/2
    assert out.metrics["arca/etr"] == pytest.approx(0.65)
    assert out.metrics["arca/weight_max_mean"] == pytest.approx(1.75)
    assert out.metrics["arca/zero_residual_frac"] == 0.0


@pytest.mark.parametrize("name", SALIENCE_METHODS)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), extra=st.integers(1, 3))
def test_finite_masked_and_padding_invariant(name, seed, extra):
    batch = make_batch(8, 5, 4, seed=seed)
    out = CreditPipeline(name)(batch)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.token_weights).all()
    assert (out.advantages[~batch.mask] == 0).all() and (out.token_weights[~batch.mask] == 0).all()
    assert all(math.isfinite(v) for v in out.metrics.values())
    padded = CreditPipeline(name)(pad_batch(batch, extra))
    torch.testing.assert_close(padded.advantages[:, :5], out.advantages)
    torch.testing.assert_close(padded.token_weights[:, :5], out.token_weights)
    assert padded.metrics == pytest.approx(out.metrics)


# ---- errors ----------------------------------------------------------------------------


def test_negative_residual_rejected_by_the_batch():
    kw = make_batch(4, 3, 2, lengths=[3, 3, 3, 3]).to_dict()
    res = kw["hidden_residual"].clone()
    res[1, 2] = -0.5
    kw["hidden_residual"] = res
    with pytest.raises(CreditInputError, match="hidden_residual.*>= 0"):
        CreditBatch(**kw)


@pytest.mark.parametrize("name,signal", [
    ("arca", "hidden_residual"), ("surprisal", "logprobs"), ("entropy", "entropy"),
    ("divergence", "ref_logprobs"), ("divergence", "logprobs"),
])
def test_missing_signal_through_pipeline(name, signal):
    batch = make_batch(4, 3, 2, signals=[s for s in tc.SIGNALS if s != signal])
    with pytest.raises(CreditInputError, match=f"{signal}.*'{name}'"):
        CreditPipeline(name)(batch)
    # and when the calibrator is called directly
    info = tc.get_method(name)
    with pytest.raises(CreditInputError, match=signal):
        info.fn(batch, torch.zeros(4, 3), info.make_config(), None)


@pytest.mark.parametrize("cls,name", [
    (ARCAConfig, "arca"), (SurprisalConfig, "surprisal"), (EntropyConfig, "entropy"), (DivergenceConfig, "divergence"),
])
def test_config_out_of_range(cls, name):
    for bad in (-0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match=f"{name} kappa"):
            cls(kappa=bad)
    for bad in (0.99, 0.0, float("nan")):
        with pytest.raises(ValueError, match=f"{name} w_max"):
            cls(w_max=bad)
    for bad in (-1e-8, float("nan"), math.inf, True):
        with pytest.raises(ValueError, match=f"{name} eps"):
            cls(eps=bad)
    for bad in (-1.0, float("nan"), math.inf, "2"):
        with pytest.raises(ValueError, match=f"{name} sharpening"):
            cls(sharpening=bad)
    assert cls(kappa=0.0, w_max=math.inf).w_max == math.inf
    assert cls(eps=0.0, sharpening=0.0).sharpening == 0.0
    with pytest.raises(ValueError, match="kappa"):
        CreditPipeline(name, **{name: {"kappa": 2.0}})


def test_wrong_advantage_shape():
    batch = make_batch(4, 3, 2)
    for name in SALIENCE_METHODS:
        info = tc.get_method(name)
        with pytest.raises(CreditInputError, match="advantages"):
            info.fn(batch, torch.zeros(4, 4), info.make_config(), None)
