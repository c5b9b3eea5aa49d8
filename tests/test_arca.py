"""ARCA and its intrinsic baselines (surprisal, entropy, divergence)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokencredit as tc
from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.methods.arca import ARCAConfig, normalize_salience
from tokencredit.methods.intrinsic import DivergenceConfig, EntropyConfig, SurprisalConfig

from helpers import make_batch, pad_batch

SALIENCE_METHODS = ["arca", "surprisal", "entropy", "divergence"]


def salience_of(name, batch):
    return {
        "arca": lambda: batch.hidden_residual,
        "surprisal": lambda: -batch.logprobs,
        "entropy": lambda: batch.entropy,
        "divergence": lambda: (batch.logprobs - batch.ref_logprobs).abs(),
    }[name]()


def _grpo(batch):
    return CreditPipeline("grpo")(batch).advantages


def _valid_means(w, mask):
    return (w * mask).sum(1) / mask.sum(1).clamp_min(1)


# ---- normalize_salience --------------------------------------------------------------


def test_hand_case_and_kappa_mixing():
    s = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    w = normalize_salience(s, m, kappa=1.0, w_max=math.inf)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 1.5, 0.0], [4.0, 0.0, 0.0, 0.0]]))
    w = normalize_salience(s, m, kappa=0.5, w_max=math.inf)
    torch.testing.assert_close(w, torch.tensor([[0.75, 1.0, 1.25, 0.0], [2.5, 0.5, 0.5, 0.5]]))
    # clipping: the one-hot row is capped at w_max
    w = normalize_salience(s, m, kappa=1.0, w_max=2.0)
    torch.testing.assert_close(w[1], torch.tensor([2.0, 0.0, 0.0, 0.0]))
    assert normalize_salience(s, m, kappa=0.0, w_max=2.0)[0, :3].tolist() == [1.0, 1.0, 1.0]


def test_all_zero_salience_row_is_uniform_not_nan():
    s = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [float("nan")] * 3])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]]).bool()
    for kappa in (1.0, 0.3):
        w = normalize_salience(s, m, kappa=kappa, w_max=5.0)
        assert torch.isfinite(w).all()
        assert w[0].tolist() == [1.0, 1.0, 1.0]
        assert w[2].tolist() == [0.0, 0.0, 0.0]  # empty row: zeros


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), kappa=st.floats(0.0, 1.0), scale=st.floats(1e-6, 1e6))
def test_mean_one_per_trajectory_and_scale_free(seed, kappa, scale):
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(5, 7, generator=gen, dtype=torch.float64) * (torch.rand(5, 7, generator=gen) < 0.8)
    m = torch.rand(5, 7, generator=gen) < 0.8
    w = normalize_salience(s, m, kappa=kappa, w_max=math.inf)
    rows = m.any(1)
    torch.testing.assert_close(_valid_means(w, m)[rows], torch.ones(int(rows.sum()), dtype=torch.float64))
    # only within-trajectory ratios matter: rescaling the salience changes nothing
    torch.testing.assert_close(normalize_salience(s * scale, m, kappa, math.inf), w)
    # and one row's salience never moves another row's weights
    s2 = s.clone()
    s2[0] = s2[0] * 3 + 1
    torch.testing.assert_close(normalize_salience(s2, m, kappa, math.inf)[1:], w[1:])


def test_clipped_weights_stay_in_range():
    gen = torch.Generator().manual_seed(0)
    s = torch.rand(6, 40, generator=gen) ** 8  # heavy-tailed: some ratios far above w_max
    m = torch.ones(6, 40, dtype=torch.bool)
    w = normalize_salience(s, m, kappa=1.0, w_max=3.0)
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


# ---- the calibrators -------------------------------------------------------------------


@pytest.mark.parametrize("name", SALIENCE_METHODS)
def test_weights_are_normalize_salience_of_the_signal(name):
    batch = make_batch(8, 7, 4, seed=3, lengths=[7, 1, 4, 0, 5, 6, 2, 3])
    cfg = {"kappa": 0.7, "w_max": 2.5}
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
    assert tc.get_method("arca").provenance == "reconstructed"
    assert tc.get_method("surprisal").requires == {"logprobs"}
    assert tc.get_method("entropy").requires == {"entropy"}
    assert tc.get_method("divergence").requires == {"logprobs", "ref_logprobs"}
    for n in ("surprisal", "entropy", "divergence"):
        assert tc.get_method(n).provenance == "paper"


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
    assert cls(kappa=0.0, w_max=math.inf).w_max == math.inf
    with pytest.raises(ValueError, match="kappa"):
        CreditPipeline(name, **{name: {"kappa": 2.0}})


def test_wrong_advantage_shape():
    batch = make_batch(4, 3, 2)
    for name in SALIENCE_METHODS:
        info = tc.get_method(name)
        with pytest.raises(CreditInputError, match="advantages"):
            info.fn(batch, torch.zeros(4, 4), info.make_config(), None)
