"""Baseline estimators: grpo, dr_grpo, rloo (hand cases, defining identities) and gae
(hand cases and agreement with a plain python double loop, holes in the mask included)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline, compute_credit
from tokencredit.credit.methods.gae import GAEConfig, gae_advantages, masked_whiten, outcome_token_rewards

from helpers import make_batch, pad_batch


def _batch(rewards, group_ids, mask=None, values=None, T=3):
    r = torch.tensor(rewards, dtype=torch.float64)
    B = len(rewards)
    m = torch.ones(B, T, dtype=torch.int64) if mask is None else torch.tensor(mask)
    v = None if values is None else torch.tensor(values, dtype=torch.float64)
    return CreditBatch(response_mask=m, rewards=r, group_ids=torch.tensor(group_ids), values=v)


# ---- grpo / dr_grpo / rloo: hand-computed ------------------------------------------------

def test_grpo_hand_case():
    b = _batch([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], [0, 0, 0, 0, 1, 1], mask=[[1, 1, 0]] * 6)
    adv = compute_credit("grpo", b).advantages
    # group 0: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5; group 1: mean 3, std sqrt(2)
    eps = 1e-6
    want = torch.tensor([0.75 / (0.5 + eps), -0.25 / (0.5 + eps), -0.25 / (0.5 + eps), -0.25 / (0.5 + eps),
                         -1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps)], dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], want)
    torch.testing.assert_close(adv[:, 1], want)
    assert (adv[:, 2] == 0).all()


def test_grpo_equal_rewards_give_exactly_zero_and_std_toggle():
    b = _batch([1.0, 1.0, 0.0, 2.0], [0, 0, 1, 1], mask=[[1, 1, 0]] * 4)
    adv = compute_credit("grpo", b).advantages
    assert (adv[:2] == 0).all()  # no signal in a group of equal rewards, and no NaN from std = 0
    raw = compute_credit("grpo", b, grpo={"std_normalize": False}).advantages
    torch.testing.assert_close(raw[2:, 0], torch.tensor([-1.0, 1.0], dtype=raw.dtype))
    assert not torch.allclose(raw[2:, 0], adv[2:, 0])


def test_dr_grpo_hand_case_and_equals_grpo_without_std():
    b = _batch([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], [0, 0, 0, 0, 1, 1], mask=[[1, 1, 0]] * 6)
    adv = compute_credit("dr_grpo", b).advantages
    want = torch.tensor([0.75, -0.25, -0.25, -0.25, -1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(adv[:, 0], want)
    torch.testing.assert_close(adv[:, 1], want)
    assert (adv[:, 2] == 0).all()
    big = make_batch(12, 5, 4, seed=1, binary_rewards=False)
    torch.testing.assert_close(
        compute_credit("dr_grpo", big).advantages,
        compute_credit("grpo", big, grpo={"std_normalize": False}).advantages,
    )


def test_rloo_hand_case():
    b = _batch([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], [5, 5, 5, 5, 9, 9])
    adv = compute_credit("rloo", b).advantages
    # 1 - 0 = 1; 0 - 1/3 for the others; pair: 2 - 4 and 4 - 2
    want = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -2.0, 2.0], dtype=torch.float64)
    for t in range(3):
        torch.testing.assert_close(adv[:, t], want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), gsize=st.integers(2, 5), n_groups=st.integers(1, 3))
def test_rloo_is_leave_one_out_mean_and_scaled_dr_grpo(seed, gsize, n_groups):
    b = make_batch(gsize * n_groups, 4, gsize, seed=seed, binary_rewards=False)
    adv = compute_credit("rloo", b).advantages
    r = b.rewards.tolist()
    g = b.group_ids.tolist()
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        want = r[i] - sum(others) / len(others)
        row = adv[i][b.mask[i]]
        assert torch.allclose(row, torch.full_like(row, want), atol=1e-6)
    # RLOO = K / (K - 1) * Dr. GRPO
    torch.testing.assert_close(adv, compute_credit("dr_grpo", b).advantages * gsize / (gsize - 1))


@pytest.mark.parametrize("spec", ["dr_grpo", "rloo"])
def test_group_estimators_reject_singleton_groups(spec):
    b = _batch([1.0, 0.0, 1.0], [0, 0, 1])
    with pytest.raises(CreditInputError, match="group_ids"):
        compute_credit(spec, b)


@pytest.mark.parametrize("spec", ["grpo", "dr_grpo", "rloo", "gae"])
def test_finite_zero_on_mask_padding_invariant(spec):
    b = make_batch(8, 6, 4, seed=7, lengths=[3, 0, 6, 1, 2, 5, 6, 4])
    out = compute_credit(spec, b)
    assert torch.isfinite(out.advantages).all()
    assert (out.advantages[~b.mask] == 0).all()
    pad = compute_credit(spec, pad_batch(b, 3))
    torch.testing.assert_close(pad.advantages[:, :6], out.advantages)
    assert (pad.advantages[:, 6:] == 0).all()
    if out.returns is not None:
        torch.testing.assert_close(pad.returns[:, :6], out.returns)
        assert (out.returns[~b.mask] == 0).all()


# ---- gae ---------------------------------------------------------------------------------

def _reference_gae(rewards, values, mask, gamma, lam):
    """Plain python: collect each row's valid positions, run the textbook recursion on them."""
    B, T = len(mask), len(mask[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        running = 0.0
        for k in range(len(idx) - 1, -1, -1):
            t = idx[k]
            last = k == len(idx) - 1
            r = rewards[b] if last else 0.0
            v_next = 0.0 if last else values[b][idx[k + 1]]
            delta = r + gamma * v_next - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    return torch.tensor(adv, dtype=torch.float64)


def test_gae_hand_case_with_hole():
    # one row, tokens at t = 0, 1, 3 (t = 2 is an environment token), padding at t = 4
    b = _batch([1.0], [0], mask=[[1, 1, 0, 1, 0]], values=[[0.2, 0.4, float("nan"), 0.5, float("nan"), 7.0]], T=5)
    gamma, lam = 0.9, 0.5
    out = compute_credit("gae", b, gae={"gamma": gamma, "lam": lam, "whiten": False})
    d3 = 1.0 + 0.0 - 0.5  # last token: reward, terminal value 0
    d1 = 0.0 + gamma * 0.5 - 0.4  # next valid value skips the hole
    d0 = 0.0 + gamma * 0.4 - 0.2
    a3 = d3
    a1 = d1 + gamma * lam * a3
    a0 = d0 + gamma * lam * a1
    want = torch.tensor([[a0, a1, 0.0, a3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, want)
    torch.testing.assert_close(out.returns, want + torch.tensor([[0.2, 0.4, 0.0, 0.5, 0.0]], dtype=torch.float64))


def test_gae_gamma_lam_one_is_outcome_minus_value_and_lam_zero_is_td():
    b = make_batch(4, 5, 2, seed=2, lengths=[5, 3, 1, 4])
    v = b.values.double()
    R = b.rewards.double()
    one = compute_credit("gae", b, gae={"gamma": 1.0, "lam": 1.0, "whiten": False}).advantages
    want = (R.unsqueeze(1) - v[:, :5]) * b.fmask.double()
    torch.testing.assert_close(one.double(), want, rtol=1e-6, atol=1e-6)
    td = compute_credit("gae", b, gae={"gamma": 1.0, "lam": 0.0, "whiten": False}).advantages
    # row 1 has length 3: V(h_1) - V(h_0), V(h_2) - V(h_1), R - V(h_2)
    torch.testing.assert_close(
        td[1, :3].double(), torch.stack([v[1, 1] - v[1, 0], v[1, 2] - v[1, 1], R[1] - v[1, 2]]), rtol=1e-6, atol=1e-6
    )


def test_gae_defaults_are_verls_gamma_lam_one():
    # verl AlgoConfig: gamma = lam = 1.0 (0.95 is TRL's lam), so the default raw GAE is R - V(h_t)
    assert (GAEConfig().gamma, GAEConfig().lam) == (1.0, 1.0)
    b = make_batch(4, 5, 2, seed=2, lengths=[5, 3, 1, 4])
    raw = compute_credit("gae", b, gae={"whiten": False}).advantages.double()
    want = (b.rewards.double().unsqueeze(1) - b.values.double()[:, :5]) * b.fmask.double()
    torch.testing.assert_close(raw, want, rtol=1e-6, atol=1e-6)


masks_with_holes = st.integers(1, 4).flatmap(
    lambda B: st.integers(1, 7).flatmap(
        lambda T: st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=B, max_size=B)
    )
)


@settings(max_examples=30, deadline=None)
@given(mask=masks_with_holes, seed=st.integers(0, 10_000),
       gamma=st.sampled_from([1.0, 0.99, 0.5, 0.0]), lam=st.sampled_from([1.0, 0.95, 0.3, 0.0]))
def test_gae_matches_python_double_loop_with_holes(mask, seed, gamma, lam):
    B, T = len(mask), len(mask[0])
    gen = torch.Generator().manual_seed(seed)
    m = torch.tensor(mask, dtype=torch.bool)
    R = torch.randn(B, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T + 1, generator=gen, dtype=torch.float64)
    values_nan = torch.where(torch.cat([m, torch.zeros(B, 1, dtype=torch.bool)], 1), values, torch.nan)
    want = _reference_gae(R.tolist(), values.tolist(), mask, gamma, lam)
    got = gae_advantages(outcome_token_rewards(R, m), values_nan, m, gamma, lam)
    torch.testing.assert_close(got, want)
    b = CreditBatch(response_mask=m, rewards=R, group_ids=torch.zeros(B, dtype=torch.long), values=values_nan)
    out = compute_credit("gae", b, gae={"gamma": gamma, "lam": lam, "whiten": False})
    torch.testing.assert_close(out.advantages, want)
    torch.testing.assert_close(out.returns, torch.where(m, want + values[:, :T], 0.0))


def test_outcome_reward_sits_on_last_valid_token():
    m = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    r = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), m)
    assert r.tolist() == [[0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, 4]]


def test_gae_whitening_default_and_statistics():
    assert GAEConfig().whiten is True
    b = make_batch(8, 6, 4, seed=5, lengths=[3, 0, 6, 1, 2, 5, 6, 4])
    raw = compute_credit("gae", b, gae={"whiten": False})
    white = compute_credit("gae", b)
    a = white.advantages[b.mask].double()
    assert abs(a.mean().item()) < 1e-5
    assert abs(a.std().item() - 1.0) < 1e-3
    x = raw.advantages[b.mask].double()
    torch.testing.assert_close(a, (x - x.mean()) / x.std(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(white.returns, raw.returns)  # returns come before whitening
    # one valid token: variance 0 -> whitened advantage 0, not NaN
    one = masked_whiten(torch.tensor([[3.0, 5.0]]), torch.tensor([[True, False]]), 1e-8)
    assert one.tolist() == [[0.0, 0.0]]


def test_gae_does_not_differentiate_through_values():
    v = torch.rand(2, 4, dtype=torch.float64, requires_grad=True)
    b = CreditBatch(response_mask=torch.ones(2, 3), rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
                    group_ids=torch.tensor([0, 0]), values=v)
    assert not compute_credit("gae", b).advantages.requires_grad


def test_gae_errors():
    b = make_batch(4, 5, 2, seed=0, signals=("logprobs",))
    with pytest.raises(CreditInputError, match="values"):
        CreditPipeline("gae")(b)
    with pytest.raises(ValueError, match="gamma"):
        CreditPipeline("gae", gae={"gamma": 1.5})
    with pytest.raises(ValueError, match="lam"):
        CreditPipeline("gae", gae={"lam": -0.1})
    with pytest.raises(ValueError, match="whiten_eps"):
        CreditPipeline("gae", gae={"whiten_eps": 0.0})
    with pytest.raises(CreditInputError, match="values"):
        CreditBatch(response_mask=torch.ones(2, 3), rewards=torch.zeros(2), group_ids=torch.zeros(2, dtype=torch.long),
                    values=torch.zeros(2, 3))
