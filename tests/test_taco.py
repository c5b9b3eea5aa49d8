"""TACO: tail-aware damping of positive credit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.taco import TACOConfig, linear_quantile, taco

from helpers import make_batch, pad_batch


def _batch(logprobs, entropy, mask=None, old_logprobs=None):
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
        old_logprobs=None if old_logprobs is None else torch.as_tensor(old_logprobs, dtype=torch.float64),
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
    # reference metric: tail weight of every valid token (tokens 0, 2, 3 are in the tail with the
    # same r; 2 and 3 keep their credit, but their tail weight counts), 1 outside the tail
    assert out.metrics["taco/weight_mean"] == pytest.approx((3 * w0 + 1.0) / 4)
    assert out.metrics["taco/weight_mean_pos"] == pytest.approx((w0 + 1.0) / 2)


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


def test_weight_mean_is_over_all_valid_tokens():
    # reference metric (compute_taco_token_advantages): masked mean of the tail weight over every
    # valid token, whatever the sign of its advantage; padding (last position) is not counted
    alpha, lam = 0.01, 0.9
    lp = [[-10.0, -12.0, -1.0, -10.0]]
    ent = [[1.0, 0.5, 0.0, float("nan")]]
    b = _batch(lp, ent, mask=[[1, 1, 1, 0]])
    adv = torch.tensor([[-1.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(alpha=alpha, lam=lam))
    w = [1 - lam * (1 - math.exp(-(10.0 - 1.0 + math.log(alpha)))),
         1 - lam * (1 - math.exp(-(12.0 - 0.5 + math.log(alpha)))), 1.0]  # token 2: r = 1 + log(.01) < 0
    assert out.metrics["taco/weight_mean"] == pytest.approx(sum(w) / 3)
    # nothing with A > 0 is in the tail: the positive-only mean is 1 and the credit unchanged
    assert out.metrics["taco/weight_mean_pos"] == 1.0
    torch.testing.assert_close(out.advantages, torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64))


def test_defaults_are_the_reference_configs():
    c = TACOConfig()
    # xiuyilou/TACO verl/trainer/config/actor/actor.yaml
    assert (c.alpha, c.lam, c.mode) == (0.01, 0.9, "taco")
    assert c.ar_lopti_alpha == 0.1
    assert (c.stapo_prob_threshold, c.stapo_entropy_quantile, c.stapo_only_positive) == (0.002, 0.1, True)
    assert c.stapo_micro_batch_size is None
    assert (c.tampo_prob_threshold, c.tampo_entropy_threshold) == (0.002, 0.5)


def test_ar_lopti_reweights_every_token_with_the_rollout_probability():
    # current policy p = 0.5 everywhere; the rollout (old) policy's p differs per token
    p_old = [0.2, 0.6, 1.0, 0.1, 0.3]
    b = _batch([[math.log(0.5)] * 5], [[0.3] * 5], mask=[[1, 1, 1, 1, 0]],
               old_logprobs=[[math.log(p) for p in p_old]])
    adv = torch.tensor([[2.0, -1.0, 0.0, -4.0, 7.0]], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(mode="ar_lopti"))
    w = torch.tensor([[0.9 + 0.1 * p for p in p_old]], dtype=torch.float64)
    w[0, 4] = 0.0  # padding
    # negative credit is reweighted too: -1 * 0.96, -4 * 0.91
    torch.testing.assert_close(out.advantages, torch.tensor([[1.84, -0.96, 0.0, -3.64, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(out.token_weights, w)
    assert out.metrics["taco/weight_mean"] == pytest.approx((0.92 + 0.96 + 1.0 + 0.91) / 4)
    assert out.metrics["taco/weight_mean_pos"] == pytest.approx(0.92)
    assert out.metrics["taco/ar_lopti_prob_mean"] == pytest.approx((0.2 + 0.6 + 1.0 + 0.1) / 4)
    out = taco(b, adv, TACOConfig(mode="ar_lopti", ar_lopti_alpha=0.0))
    assert torch.equal(out.advantages, adv * b.fmask)


def test_ar_lopti_needs_old_logprobs_and_only_that_mode_does():
    b = _batch([[-1.0, -2.0]], [[0.5, 0.5]])
    adv = torch.ones(1, 2, dtype=torch.float64)
    with pytest.raises(CreditInputError, match="old_logprobs.*ar_lopti"):
        taco(b, adv, TACOConfig(mode="ar_lopti"))
    for mode in ("taco", "stapo", "tampo"):
        taco(b, adv, TACOConfig(mode=mode))
    # the plain spec does not demand it either (the README's batch has no old_logprobs)
    rb = make_batch(8, 6, 4, seed=2, signals=("logprobs", "entropy"))
    CreditPipeline("taco")(rb)
    with pytest.raises(CreditInputError, match="old_logprobs"):
        CreditPipeline("taco", taco={"mode": "ar_lopti"})(rb)


def test_stapo_hand_case():
    # row 0: A > 0, four valid tokens and one padding position; row 1: A < 0, five valid tokens.
    # candidates = row 0's valid tokens, entropies [0, 1, 2, 3]: torch.quantile(.., 0.1), linear,
    # is 0 + 0.3 * (1 - 0) = 0.3. Over all nine valid tokens it would be 0 (nothing silenced);
    # with the padding position (entropy 0 once zeroed) 0 too.
    p1 = math.log(1e-3)
    lp = [[p1, p1, p1, math.log(0.5), p1], [p1, p1, p1, p1, p1]]
    ent = [[0.0, 1.0, 2.0, 3.0, float("nan")], [0.0, 0.5, 4.0, 5.0, 6.0]]
    b = _batch(lp, ent, mask=[[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    adv = torch.tensor([[1.0] * 5, [-1.0] * 5], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(mode="stapo"))
    want = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [-1.0] * 5], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, want)
    assert out.metrics["taco/stapo_entropy_threshold"] == pytest.approx(0.3)
    assert out.metrics["taco/stapo_candidate_frac"] == pytest.approx(4 / 9)
    assert out.metrics["taco/silenced_candidate_frac"] == pytest.approx(1 / 4)
    assert out.metrics["taco/silenced_token_frac"] == pytest.approx(1 / 9)
    assert out.metrics["taco/weight_mean"] == pytest.approx(8 / 9)
    assert out.metrics["taco/weight_mean_pos"] == pytest.approx(3 / 4)
    # only_positive off: candidates are all nine valid tokens, sorted entropies
    # [0, 0, 0.5, 1, 2, 3, 4, 5, 6]; quantile 0.3 -> rank 2.4 -> 0.5 + 0.4 * 0.5 = 0.7; negative
    # credit is silenced too (row 1's first two tokens)
    out = taco(b, adv, TACOConfig(mode="stapo", stapo_only_positive=False, stapo_entropy_quantile=0.3))
    want = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, want)
    assert out.metrics["taco/stapo_entropy_threshold"] == pytest.approx(0.7)


def test_stapo_thresholds_are_strict():
    # six positive tokens, entropies [0, 0, 0.5, 0.5, 2, 3]; quantile 0.4 -> rank 0.4 * 5 = 2.0
    # exactly, so the entropy threshold is exactly 0.5
    lp = torch.tensor([[math.log(1e-4), math.log(1e-3), math.log(1e-4), math.log(0.5), math.log(1e-4),
                        math.log(0.5)]], dtype=torch.float64)
    ent = [[0.0, 0.0, 0.5, 0.5, 2.0, 3.0]]
    b = _batch(lp, ent)
    p_at = float(torch.exp(lp)[0, 1])  # token 1's probability is exactly the threshold
    adv = torch.ones(1, 6, dtype=torch.float64)
    out = taco(b, adv, TACOConfig(mode="stapo", stapo_entropy_quantile=0.4, stapo_prob_threshold=p_at))
    assert out.metrics["taco/stapo_entropy_threshold"] == 0.5
    # token 0 silenced; token 1 has p == threshold, token 2 has H == threshold: both kept
    assert out.advantages.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]]


def test_stapo_quantile_per_micro_batch():
    # row 0 entropies [0, 1, 2, 3] -> 0.3; row 1 [10, 11, 12, 13] -> 10.3; together -> 0.7
    p1 = math.log(1e-3)
    b = _batch([[p1] * 4] * 2, [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]])
    adv = torch.ones(2, 4, dtype=torch.float64)
    whole = taco(b, adv, TACOConfig(mode="stapo"))
    assert whole.advantages.tolist() == [[0.0, 1.0, 1.0, 1.0], [1.0] * 4]
    per_row = taco(b, adv, TACOConfig(mode="stapo", stapo_micro_batch_size=1))
    assert per_row.advantages.tolist() == [[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    assert per_row.metrics["taco/stapo_entropy_threshold"] == pytest.approx((0.3 + 10.3) / 2)


def test_stapo_micro_batches_equal_separate_calls():
    b = make_batch(12, 7, 4, seed=5, V=30, signals=("logprobs", "entropy"))
    adv = _mixed_adv(b, 5)
    cfg = TACOConfig(mode="stapo", stapo_prob_threshold=0.3, stapo_micro_batch_size=5)
    out = taco(b, adv, cfg)
    assert (out.advantages == 0).sum() > (adv == 0).sum()  # something was silenced
    parts = []
    for s in range(0, 12, 5):
        d = {k: (v[s : s + 5] if torch.is_tensor(v) else v) for k, v in b.to_dict().items()}
        parts.append(taco(CreditBatch(**d), adv[s : s + 5], TACOConfig(mode="stapo", stapo_prob_threshold=0.3)).advantages)
    assert torch.equal(out.advantages, torch.cat(parts))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), q=st.floats(0.01, 0.99), seed=st.integers(0, 1000), double=st.booleans())
def test_linear_quantile_is_torch_quantile(n, q, seed, double):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64 if double else torch.float32)
    assert torch.equal(linear_quantile(x, q), torch.quantile(x, q))


def test_tampo_hand_case():
    # positive row: truncated where p <= 0.002 and H <= 0.5 (both non-strict)
    lp = [[math.log(1e-3), math.log(1e-3), math.log(1e-3), math.log(0.01), 0.0],
          [math.log(1e-3), math.log(1e-3), math.log(1e-3), math.log(1e-3), math.log(1e-3)]]
    ent = [[0.1, 0.5, 0.6, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, float("nan")]]
    b = _batch(lp, ent, mask=[[1] * 5, [1, 1, 1, 1, 0]])
    adv = torch.tensor([[1.0] * 5, [-1.0, 0.0, -2.0, -1.0, 3.0]], dtype=torch.float64)
    out = taco(b, adv, TACOConfig(mode="tampo"))
    # token 0 truncated, token 1 too (H == 0.5), token 2 has H > 0.5, token 3 p > 0.002, token 4
    # p = 1; row 1 has no positive credit (A <= 0 untouched)
    want = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0], [-1.0, 0.0, -2.0, -1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, want)
    assert out.metrics["taco/silenced_token_frac"] == pytest.approx(2 / 9)
    assert out.metrics["taco/silenced_candidate_frac"] == pytest.approx(2 / 5)
    assert out.metrics["taco/weight_mean"] == pytest.approx(7 / 9)
    assert out.metrics["taco/weight_mean_pos"] == pytest.approx(3 / 5)
    # p == the probability threshold is truncated too: token 4 has p = exp(0) = 1 exactly
    out = taco(b, adv, TACOConfig(mode="tampo", tampo_prob_threshold=1.0))
    assert out.advantages[0].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", ["taco", "ar_lopti", "stapo", "tampo"])
def test_finite_masked_and_padding_invariant(mode):
    b = make_batch(8, 6, 4, seed=7, V=200, lengths=[6, 0, 3, 1, 6, 2, 5, 4],
                   signals=("logprobs", "old_logprobs", "entropy"))
    adv = _mixed_adv(b, 3)
    # thresholds loose enough that every mode changes some token of this random batch
    cfg = TACOConfig(mode=mode, alpha=0.5, stapo_prob_threshold=0.5, tampo_prob_threshold=0.5,
                     tampo_entropy_threshold=5.0)
    out = taco(b, adv, cfg)
    assert not torch.equal(out.advantages, adv)
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
    assert {k for k in out.metrics if k.startswith("taco/")} == {"taco/weight_mean", "taco/weight_mean_pos", "taco/tail_risk_mean",
                                "taco/tail_token_frac", "taco/positive_adv_token_frac"}
    for bad, field in [({"alpha": 0.0}, "alpha"), ({"alpha": -1.0}, "alpha"), ({"alpha": math.inf}, "alpha"),
                       ({"lam": 1.1}, "lam"), ({"lam": -0.1}, "lam"), ({"mode": "x"}, "mode"),
                       ({"ar_lopti_alpha": 1.5}, "ar_lopti_alpha"), ({"ar_lopti_alpha": -0.1}, "ar_lopti_alpha"),
                       ({"stapo_prob_threshold": 0.0}, "stapo_prob_threshold"),
                       ({"stapo_prob_threshold": 1.0}, "stapo_prob_threshold"),
                       ({"stapo_entropy_quantile": 0.0}, "stapo_entropy_quantile"),
                       ({"stapo_entropy_quantile": 1.0}, "stapo_entropy_quantile"),
                       ({"stapo_only_positive": 1}, "stapo_only_positive"),
                       ({"stapo_micro_batch_size": 0}, "stapo_micro_batch_size"),
                       ({"stapo_micro_batch_size": 2.0}, "stapo_micro_batch_size"),
                       ({"tampo_prob_threshold": 1.5}, "tampo_prob_threshold"),
                       ({"tampo_entropy_threshold": -1.0}, "tampo_entropy_threshold"),
                       ({"tampo_entropy_threshold": math.nan}, "tampo_entropy_threshold")]:
        with pytest.raises(ValueError, match=field):
            CreditPipeline("taco", taco=bad)
    with pytest.raises(CreditInputError, match="entropy"):
        CreditPipeline("taco")(b.replace(entropy=None))
    with pytest.raises(CreditInputError, match="logprobs"):
        CreditPipeline("taco")(b.replace(logprobs=None))
    with pytest.raises(CreditInputError, match="advantages"):
        taco(b, torch.zeros(8, 5), TACOConfig())
