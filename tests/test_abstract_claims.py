"""The abstracts' statements that hold exactly on a small tabular policy, checked by enumeration.

The world is PACT's (tests/test_pact.py): vocabulary {0, 1, 2}, horizon 3, a fixed random
softmax policy pi(y | h) per prefix, rewards in [0, 1], and in the EOS variant early stops and
padding. The policy's parameters are its logits theta[h, y], so the score of token y at h is
``e_y - pi(. | h)`` on h's block and 0 elsewhere; every expectation below is an exact sum over
all complete sequences weighted by their probability.

- OPPO (abstract: "a directional variance-reduction guarantee"): with the ideal oracle (the
  success-conditioned policy pi(y | h) V(h y) / V(h)) OPPO's belief is V(h_t) and its credit is
  c_t = V(h_{t+1}) - V(h_t). Our reading of "directional": for every token position and every
  direction u in parameter space, the token's gradient term c_t u.grad log pi(y_t | h_t) has the
  mean of the outcome term (R - V(h_t)) u.grad log pi and no larger variance (Rao-Blackwell:
  the gap is E[(R - V(h_{t+1}))^2 (u.grad log pi)^2] >= 0).
- PACT (abstract: "Response-level RLOO signals match the expected policy-gradient contribution
  of token-level credit"): over groups of K independent responses, the expected RLOO gradient
  equals E[sum_t c_t grad log pi(y_t | h_t)], and both equal grad E[R] (by autograd).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.credit.methods.oppo import OPPOConfig, oppo

from test_pact import HORIZON, VOCAB, TabularWorld


def _params(world):
    keys = sorted(world.pi, key=lambda h: (len(h), h))
    return {h: i for i, h in enumerate(keys)}


def _score(world, index, h, y):
    g = torch.zeros(len(index), VOCAB, dtype=torch.float64)
    g[index[h]] = -torch.tensor(world.pi[h], dtype=torch.float64)
    g[index[h], y] += 1.0
    return g.flatten()


def _prob(world, s):
    return math.prod(world.pi[s[:t]][y] for t, y in enumerate(s))


def _exact_oracle_batch(world, seqs):
    """Two rows per sequence: the sequence with the ideal oracle's log-probs, and a partner row
    whose reward is V(()) so that the leave-one-out prior of the first row is V(())."""
    B, T = 2 * len(seqs), HORIZON
    mask = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float64)
    orc = torch.zeros(B, T, dtype=torch.float64)
    R = torch.zeros(B, dtype=torch.float64)
    v0 = world.V(())
    for i, s in enumerate(seqs):
        for t, y in enumerate(s):
            h = s[:t]
            mask[2 * i, t] = mask[2 * i + 1, t] = True
            lp = math.log(world.pi[h][y])
            logp[2 * i, t] = logp[2 * i + 1, t] = lp
            # a last token with reward 0 has V = 0 (the oracle never takes it): a finite floor,
            # whose belief the terminal V := R overwrites
            orc[2 * i, t] = orc[2 * i + 1, t] = lp + math.log(max(world.V(h + (y,)), 1e-300)) - math.log(world.V(h))
        R[2 * i], R[2 * i + 1] = world.reward(s), v0
    return CreditBatch(response_mask=mask, rewards=R, group_ids=torch.arange(B) // 2, logprobs=logp, oracle_logprobs=orc)


@pytest.mark.parametrize("eos", [False, True], ids=["fixed_length", "eos_padding"])
def test_oppo_ideal_oracle_credit_is_token_credit_with_lower_variance_in_every_direction(eos):
    world = TabularWorld(eos=eos, seed=1)
    seqs = world.sequences()
    assert min(world.V(s[:t]) for s in seqs for t in range(len(s))) > 0.01  # the oracle is defined
    batch = _exact_oracle_batch(world, seqs)
    cfg = OPPOConfig(form="probability", anchor="off", evidence_clip=math.inf, prior="leave_one_out", eps=1e-9)
    adv = oppo(batch, cfg).advantages[0::2]
    index = _params(world)
    D = len(index) * VOCAB
    for t in range(HORIZON):
        mean_x = torch.zeros(D, dtype=torch.float64)
        mean_y = torch.zeros(D, dtype=torch.float64)
        second_x = torch.zeros(D, D, dtype=torch.float64)
        second_y = torch.zeros(D, D, dtype=torch.float64)
        gap = torch.zeros(D, D, dtype=torch.float64)
        for i, s in enumerate(seqs):
            if len(s) <= t:
                continue
            h, y = s[:t], s[t]
            c = world.V(h + (y,)) - world.V(h)
            assert float(adv[i, t]) == pytest.approx(c, abs=1e-9)  # OPPO's credit = PACT's c_t
            p = _prob(world, s)
            sc = _score(world, index, h, y)
            x = float(adv[i, t]) * sc
            yv = (world.reward(s) - world.V(h)) * sc
            mean_x += p * x
            mean_y += p * yv
            second_x += p * torch.outer(x, x)
            second_y += p * torch.outer(yv, yv)
            gap += p * (world.reward(s) - world.V(h + (y,))) ** 2 * torch.outer(sc, sc)
        torch.testing.assert_close(mean_x, mean_y, atol=1e-12, rtol=0)  # same expected gradient
        cov_x = second_x - torch.outer(mean_x, mean_x)
        cov_y = second_y - torch.outer(mean_y, mean_y)
        diff = cov_y - cov_x
        torch.testing.assert_close(diff, gap, atol=1e-12, rtol=0)  # Rao-Blackwell gap, exactly
        assert float(torch.linalg.eigvalsh(diff).min()) > -1e-12  # no direction gets noisier
        if t < HORIZON - 1:
            assert float(torch.linalg.eigvalsh(diff).max()) > 1e-4  # and some strictly less noisy


def _grad_expected_reward(world, seqs, index):
    """grad_theta E[R] for the softmax logits theta[h] = log pi(. | h), by autograd."""
    theta = torch.zeros(len(index), VOCAB, dtype=torch.float64)
    for h, i in index.items():
        theta[i] = torch.log(torch.tensor(world.pi[h], dtype=torch.float64))
    theta.requires_grad_(True)
    logpi = torch.log_softmax(theta, -1)
    J = sum(torch.exp(sum(logpi[index[s[:t]], y] for t, y in enumerate(s))) * world.reward(s) for s in seqs)
    (g,) = torch.autograd.grad(J, theta)
    return g.flatten()


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("eos", [False, True], ids=["fixed_length", "eos_padding"])
def test_pact_rloo_matches_the_expected_gradient_of_token_credit(eos, K):
    world = TabularWorld(eos=eos, seed=2)
    seqs = world.sequences()
    index = _params(world)
    scores = [sum(_score(world, index, s[:t], y) for t, y in enumerate(s)) for s in seqs]
    credit = torch.zeros(len(index) * VOCAB, dtype=torch.float64)
    for s in seqs:
        credit += _prob(world, s) * sum((world.V(s[:t + 1]) - world.V(s[:t])) * _score(world, index, s[:t], y)
                                        for t, y in enumerate(s))
    # every group of K independent responses, as one batch of groups through the rloo method
    groups = list(itertools.product(range(len(seqs)), repeat=K))
    B = len(groups) * K
    mask = torch.zeros(B, HORIZON, dtype=torch.bool)
    R = torch.zeros(B, dtype=torch.float64)
    for g, members in enumerate(groups):
        for k, i in enumerate(members):
            mask[g * K + k, : len(seqs[i])] = True
            R[g * K + k] = world.reward(seqs[i])
    adv = CreditPipeline("rloo")(CreditBatch(response_mask=mask, rewards=R, group_ids=torch.arange(B) // K)).advantages
    rloo = torch.zeros_like(credit)
    for g, members in enumerate(groups):
        p = math.prod(_prob(world, seqs[i]) for i in members)
        for k, i in enumerate(members):
            rloo += p * float(adv[g * K + k, 0]) * scores[i] / K  # mean over the group's responses
    exact = _grad_expected_reward(world, seqs, index)
    torch.testing.assert_close(credit, exact, atol=1e-12, rtol=0)
    torch.testing.assert_close(rloo, credit, atol=1e-12, rtol=0)
    assert float(exact.abs().max()) > 1e-3


@pytest.mark.parametrize("eos", [False, True], ids=["fixed_length", "eos_padding"])
def test_pact_ideal_opd_teacher_is_an_implicit_critic(eos):
    """PACT (abstract): "an ideal teacher in OPD acts as an implicit critic, yielding an expected
    policy gradient proportional to that induced by token-level credit". The ideal teacher is
    the success-conditioned policy pi*(y | h) = pi(y | h) V(h y) / V(h); the `opd` method's reward
    with it is e = log pi* - log pi = log V(h y) - log V(h). Our reading, checked per state h by
    enumeration: the teacher's likelihood ratio is the critic's credit scaled by the state,
    pi*/pi - 1 = c / V(h), so the expected gradient of that ratio reward is exactly the token
    credit's, times 1 / V(h) > 0 (proportional, state by state); OPD's log reward is its first
    order (log(1 + x) = x + O(x^2)), within |log(1 + x) - x| of it in every state."""
    from tokencredit.credit.methods.opd import OPDConfig, opd

    world = TabularWorld(eos=eos, seed=1)
    index = _params(world)
    for h in world.pi:
        if world.V(h) <= 0:
            continue
        ys = list(range(VOCAB))
        Vc = [world.V(h + (y,)) for y in ys]
        lp = torch.tensor([[math.log(world.pi[h][y])] for y in ys], dtype=torch.float64)
        orc = torch.tensor([[math.log(world.pi[h][y]) + math.log(max(v, 1e-300)) - math.log(world.V(h))] for y, v in zip(ys, Vc)],
                           dtype=torch.float64)
        batch = CreditBatch(response_mask=torch.ones(VOCAB, 1), rewards=torch.zeros(VOCAB, dtype=torch.float64),
                            group_ids=torch.zeros(VOCAB, dtype=torch.long), logprobs=lp, oracle_logprobs=orc)
        e = opd(batch, OPDConfig()).advantages[:, 0]
        pi = torch.tensor(world.pi[h], dtype=torch.float64)
        c = torch.tensor(Vc, dtype=torch.float64) - world.V(h)
        torch.testing.assert_close(torch.exp(e) - 1, c / world.V(h), atol=1e-12, rtol=0)  # the ratio is the credit / V
        scores = torch.stack([_score(world, index, h, y) for y in ys])
        g_c = (pi * c) @ scores
        g_ratio = (pi * (torch.exp(e) - 1)) @ scores
        torch.testing.assert_close(g_ratio, g_c / world.V(h), atol=1e-12, rtol=0)
        g_log = (pi * e.clamp_min(-50.0)) @ scores
        finite = [i for i, v in enumerate(Vc) if v > 0]
        x = (c / world.V(h))[finite]
        bound = float((pi[finite] * (torch.log1p(x) - x).abs() * scores[finite].norm(dim=1)).sum())
        if len(finite) == VOCAB:
            assert float((g_log - g_ratio).norm()) <= bound + 1e-12
