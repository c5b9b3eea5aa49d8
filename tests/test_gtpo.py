"""GTPO: entropy-shaped token rewards for O+ / O-, normalised separately per set and group."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.gtpo import GTPOConfig, gtpo

from helpers import make_batch, pad_batch

NAN = float("nan")


def _hand_batch(dtype=torch.float64):
    # one group: two correct (rows 0, 1; row 1 ends after one token), two wrong
    return CreditBatch(
        response_mask=torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]),
        rewards=torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=dtype),
        group_ids=torch.tensor([7, 7, 7, 7]),
        entropy=torch.tensor([[1.0, 2.0], [3.0, NAN], [1.0, 1.0], [0.5, 2.0]], dtype=dtype),
    )


@st.composite
def gtpo_batches(draw, binary=None):
    """Groups of 2-4 responses with holes, empty rows and NaN padding; some single-outcome groups."""
    n_groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(2, 4)) for _ in range(n_groups)]
    B, T = sum(sizes), draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    mask = torch.rand(B, T, generator=gen) < draw(st.sampled_from([0.5, 0.8, 1.0]))
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    mask[starts, torch.randint(0, T, (n_groups,), generator=gen)] = True  # no group without a token
    binary = draw(st.booleans()) if binary is None else binary
    if binary:
        rewards = (torch.rand(B, generator=gen) < 0.5).double()
    else:
        rewards = torch.rand(B, generator=gen, dtype=torch.float64)
    ent = torch.rand(B, T, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.01, 1.0, 5.0]))
    if draw(st.booleans()):
        ent = torch.where(torch.rand(B, T, generator=gen) < 0.3, torch.zeros_like(ent), ent)  # exact zeros
    ent = torch.where(mask, ent, torch.full_like(ent, NAN))
    groups = torch.repeat_interleave(torch.arange(n_groups) * 3 + 2, torch.tensor(sizes))
    return CreditBatch(response_mask=mask.long(), rewards=rewards, group_ids=groups, entropy=ent)


def _sets(batch, cfg):
    pos = batch.rewards > cfg.success_threshold
    ids = batch.group_ids
    n_pos = torch.stack([pos[ids == ids[b]].sum() for b in range(len(ids))])
    size = torch.stack([(ids == ids[b]).sum() for b in range(len(ids))])
    mixed = (n_pos > 0) & (n_pos < size)
    return pos, mixed


# ---- hand-computed case --------------------------------------------------------------


def test_hand_computed_group_of_two_correct_two_wrong():
    batch = _hand_batch()
    # O+ at t=0: H 1, 3 of sum 4, d=2 -> bonus 0.5, 1.5; t=1: row 0 alone -> bonus 1
    # O- at t=0: 1/H = 1, 2 of sum 3, h=2 -> 2/3, 4/3; t=1: 1/H = 1, 1/2 of 3/2 -> 4/3, 2/3
    raw = torch.tensor([[1.05, 1.10], [1.15, 0.0], [-16 / 15, -17 / 15], [-17 / 15, -16 / 15]], dtype=torch.float64)
    cfg = dict(eps=1e-12)
    out = gtpo(batch, GTPOConfig(normalize="none", **cfg)).advantages
    torch.testing.assert_close(out, raw)
    # "mean": O+ token mean 1.1, O- mean |r| 1.1
    out = gtpo(batch, GTPOConfig(**cfg)).advantages
    torch.testing.assert_close(out, raw / 1.1)
    # "zscore": O+ deviations -0.05, 0, +0.05 with population std sqrt(0.005 / 3);
    # O- deviations +-1/30 with std 1/30. Signs are not preserved.
    out = gtpo(batch, GTPOConfig(normalize="zscore", norm_eps=1e-12, **cfg)).advantages
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(out, torch.tensor([[-1 / s, 0.0], [1 / s, 0.0], [1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64))
    # a1, a2 enter linearly: a2 = 0 removes the entropy term
    out = gtpo(batch, GTPOConfig(normalize="none", a2=0.0, **cfg)).advantages
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0], [1.0, 0.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64))


def test_metrics_hand_case():
    m = gtpo(_hand_batch(), GTPOConfig(eps=1e-12)).metrics
    assert m["gtpo/pos_frac"] == pytest.approx(0.5)
    assert m["gtpo/single_outcome_group_frac"] == 0.0
    assert m["gtpo/pos_adv_mean"] == pytest.approx(1.0)
    assert m["gtpo/neg_adv_mean"] == pytest.approx(-1.0)
    assert m["gtpo/bonus_max_pos"] == pytest.approx(1.5)
    assert m["gtpo/bonus_max_neg"] == pytest.approx(4 / 3)


# ---- defining properties -------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(batch=gtpo_batches(), normalize=st.sampled_from(["mean", "none"]), thr=st.sampled_from([0.0, 0.5]))
def test_successes_positive_failures_negative_single_outcome_zero(batch, normalize, thr):
    cfg = GTPOConfig(normalize=normalize, success_threshold=thr)
    adv = gtpo(batch, cfg).advantages
    pos, mixed = _sets(batch, cfg)
    m = batch.mask
    live = m & mixed.unsqueeze(1)
    assert (adv[live & pos.unsqueeze(1)] > 0).all()
    assert (adv[live & ~pos.unsqueeze(1)] < 0).all()
    assert (adv[~live] == 0).all()
    if normalize == "mean":
        ids = batch.group_ids
        for b in range(batch.batch_size):
            if not mixed[b]:
                continue
            for sign, member in ((1.0, pos), (-1.0, ~pos)):
                sel = m & ((ids == ids[b]) & member).unsqueeze(1)
                if sel.any():
                    assert adv[sel].mean().item() == pytest.approx(sign)


@settings(max_examples=30, deadline=None)
@given(batch=gtpo_batches())
def test_entropy_bonus_is_conserved_per_position(batch):
    # the shares at a position sum to 1 over the alive responses of the set: sum bonus = count
    cfg = GTPOConfig(normalize="none", skip_single_outcome_groups=False)
    r = gtpo(batch, cfg).advantages
    pos, _ = _sets(batch, cfg)
    R = batch.rewards.unsqueeze(1)
    m, ids = batch.mask, batch.group_ids
    for gid in ids.unique():
        for member, bonus in ((pos, (r - cfg.a1 * R) / cfg.a2), (~pos, (-r - cfg.a1) / cfg.a2)):
            alive = m & ((ids == gid) & member).unsqueeze(1)
            total = torch.where(alive, bonus, torch.zeros_like(bonus)).sum(0)
            torch.testing.assert_close(total, alive.sum(0).double())


@settings(max_examples=30, deadline=None)
@given(batch=gtpo_batches(binary=True), normalize=st.sampled_from(["mean", "zscore", "none"]))
def test_entropy_orders_credit_at_a_position(batch, normalize):
    """Same group, same position: an O+ token with more entropy gets more credit; an O- token
    with less entropy (a confident mistake) gets more blame."""
    cfg = GTPOConfig(normalize=normalize)
    adv = gtpo(batch, cfg).advantages
    pos, mixed = _sets(batch, cfg)
    m, ids, H = batch.mask, batch.group_ids, batch.entropy
    B, T = m.shape
    for t in range(T):
        for i in range(B):
            for k in range(B):
                if not (ids[i] == ids[k] and mixed[i] and m[i, t] and m[k, t] and pos[i] == pos[k]):
                    continue
                if H[i, t] > H[k, t] + 1e-9:
                    if pos[i]:
                        assert adv[i, t] > adv[k, t]
                    else:
                        assert adv[i, t] > adv[k, t]  # higher entropy -> less negative


def test_zscore_is_over_the_tokens_of_each_set_and_group_and_drops_the_outcome_term():
    """The paper's normalisation as public implementations read it: mean and population std over
    every token reward of the set (tokens, not responses; per group). With binary rewards it
    removes a1 R, the success/failure contrast, which is why "mean" is the default."""
    b = make_batch(12, 7, 4, seed=4, V=9, dtype=torch.float64, lengths=[7, 2, 5, 1, 3, 7, 6, 2, 4, 7, 1, 5],
                   signals=("entropy",))
    cfg = GTPOConfig(normalize="zscore", norm_eps=1e-12)
    adv = gtpo(b, cfg).advantages
    raw = gtpo(b, GTPOConfig(normalize="none")).advantages
    pos, mixed = _sets(b, cfg)
    assert mixed.all()
    m, ids = b.mask, b.group_ids
    n_spread = 0
    for gid in ids.unique():
        for member in (pos, ~pos):
            sel = m & ((ids == gid) & member).unsqueeze(1)
            vals = adv[sel]
            assert vals.mean().item() == pytest.approx(0.0, abs=1e-9)
            # a set whose token rewards are all equal (one response: every share is 1) -> 0
            spread = raw[sel].max() - raw[sel].min() > 1e-9
            n_spread += int(spread)
            assert vals.std(unbiased=False).item() == pytest.approx(1.0 if spread else 0.0, abs=1e-6)
    assert n_spread >= 4
    # a1 no longer matters (every O+ token shares a1 * 1, every O- token -a1) ...
    torch.testing.assert_close(gtpo(b, GTPOConfig(normalize="zscore", norm_eps=1e-12, a1=4.0)).advantages, adv)
    # ... and credit is no longer signed by the outcome; "mean" keeps it (+1 / -1 per set)
    assert (adv[m & pos.unsqueeze(1)] < 0).any() and (adv[m & ~pos.unsqueeze(1)] > 0).any()
    mean = gtpo(b, GTPOConfig()).advantages
    assert (mean[m & pos.unsqueeze(1)] > 0).all() and (mean[m & ~pos.unsqueeze(1)] < 0).all()


def test_single_outcome_groups():
    base = make_batch(4, 3, 2, seed=1, lengths=[3, 2, 3, 1], signals=("entropy",))
    allpos = base.replace(rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]))
    # group 0 all correct, group 1 all wrong: no contrast -> zero credit by default, like GRPO
    adv = CreditPipeline("gtpo")(allpos).advantages
    assert (adv == 0).all()
    assert CreditPipeline("gtpo")(allpos).metrics["gtpo/single_outcome_group_frac"] == 1.0
    torch.testing.assert_close(adv, CreditPipeline("grpo")(allpos).advantages)
    # opted in: shaped and normalised within the one set, signs kept
    adv = CreditPipeline("gtpo", gtpo={"skip_single_outcome_groups": False})(allpos).advantages
    m = allpos.mask
    assert (adv[:2][m[:2]] > 0).all() and (adv[2:][m[2:]] < 0).all()


def test_zero_entropy_is_guarded():
    b = CreditBatch(
        response_mask=torch.ones(4, 3, dtype=torch.long),
        rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]),
        group_ids=torch.zeros(4, dtype=torch.long),
        entropy=torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, -1e-7]]),
    )
    adv = gtpo(b, GTPOConfig(normalize="none")).advantages
    assert torch.isfinite(adv).all()
    # all-zero column: equal shares -> bonus 1 each; a confident (H = 0) wrong token among
    # uncertain ones takes (nearly) the whole O- bonus h_t = 2
    torch.testing.assert_close(adv[:2, 0], torch.tensor([1.1, 1.1]))
    torch.testing.assert_close(adv[2:, 0], torch.tensor([-1.1, -1.1]))
    torch.testing.assert_close(adv[2:, 1], torch.tensor([-1.0, -1.2]), atol=1e-5, rtol=0)
    # rounding below 0 is treated as 0
    torch.testing.assert_close(adv[2:, 2], torch.tensor([-1.1, -1.1]))


@settings(max_examples=30, deadline=None)
@given(batch=gtpo_batches(), normalize=st.sampled_from(["mean", "zscore", "none"]), extra=st.integers(1, 3))
def test_finite_zero_on_mask_and_padding_invariant(batch, normalize, extra):
    cfg = GTPOConfig(normalize=normalize)
    adv = gtpo(batch, cfg).advantages
    assert torch.isfinite(adv).all() and (adv[~batch.mask] == 0).all()
    padded = gtpo(pad_batch(batch, extra), cfg).advantages
    torch.testing.assert_close(padded[:, : adv.shape[1]], adv, atol=1e-9, rtol=0)
    assert (padded[:, adv.shape[1]:] == 0).all()


def test_credit_is_detached():
    batch = make_batch(4, 5, 2, seed=0)
    b = batch.replace(entropy=batch.entropy.clone().requires_grad_(True))
    assert not gtpo(b, GTPOConfig()).advantages.requires_grad


# ---- errors --------------------------------------------------------------------------


def test_missing_entropy_named():
    batch = make_batch(4, 5, 2, seed=0, signals=("logprobs",))
    with pytest.raises(CreditInputError, match="entropy"):
        CreditPipeline("gtpo")(batch)


def test_singleton_group_rejected():
    batch = make_batch(4, 5, 2, seed=0).replace(group_ids=torch.tensor([0, 0, 0, 1]))
    with pytest.raises(CreditInputError, match="group_ids"):
        CreditPipeline("gtpo")(batch)


def test_wrong_shape_rejected():
    with pytest.raises(CreditInputError, match="entropy"):
        make_batch(4, 5, 2, seed=0).replace(entropy=torch.zeros(4, 4))


@pytest.mark.parametrize("kw,field", [
    ({"success_threshold": -0.1}, "success_threshold"), ({"success_threshold": math.nan}, "success_threshold"),
    ({"a1": -1.0}, "a1"), ({"a2": math.inf}, "a2"), ({"a1": 0.0, "a2": 0.0}, "a1 \\+ a2"),
    ({"eps": 0.0}, "eps"), ({"norm_eps": -1e-6}, "norm_eps"), ({"normalize": "std"}, "normalize"),
    ({"skip_single_outcome_groups": 0}, "skip_single_outcome_groups"),
])
def test_config_out_of_range(kw, field):
    with pytest.raises(ValueError, match=field):
        GTPOConfig(**kw)
    with pytest.raises(ValueError, match=field):
        CreditPipeline("gtpo", gtpo=kw)
