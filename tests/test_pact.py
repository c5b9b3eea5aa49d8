"""PACT: the defining properties of its token credit, checked exactly in a tabular world.

The world (built here): vocabulary {0, 1, 2}, horizon 3, a fixed random policy pi(y | h) per
prefix, a deterministic reward R(sequence) in [0, 1]. In the EOS variant token 2 ends the
response early, so rows have different lengths and padding. V(h) = E[R | h] is computed
exactly by enumeration, and the batch holds every possible complete sequence with those
exact values. With mode="credit" the credit c_t = V(h_{t+1}) - V(h_t) must be complete,
prefix consistent and neutral; mode="gae" (gamma = lam = 1) must give R - V(h_t).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditBatch, CreditInputError, CreditPipeline, compute_credit
from tokencredit.credit.methods.pact import PACTConfig, pact_critic_is_weights, pact_critic_loss

from helpers import make_batch, pad_batch

VOCAB = 3
HORIZON = 3
EOS = 2


class TabularWorld:
    def __init__(self, eos: bool, seed: int = 0):
        self.eos = eos
        gen = torch.Generator().manual_seed(seed)
        self.pi = {}  # every reachable non-terminal prefix, in a fixed order
        for n in range(HORIZON):
            for h in itertools.product(range(VOCAB), repeat=n):
                if not any(self.terminal(h[:k]) for k in range(n + 1)):
                    p = torch.softmax(torch.randn(VOCAB, generator=gen, dtype=torch.float64) * 0.8, 0)
                    self.pi[h] = p.tolist()
        self.V = lru_cache(maxsize=None)(self._value)

    def terminal(self, h) -> bool:
        return len(h) == HORIZON or (self.eos and len(h) > 0 and h[-1] == EOS)

    @staticmethod
    def reward(h) -> float:
        # order-dependent, several levels in [0, 1]
        return ((5 * sum((i + 1) * y for i, y in enumerate(h)) + 3 * len(h) + 1) % 7) / 6

    def _value(self, h) -> float:
        if self.terminal(h):
            return self.reward(h)
        return sum(p * self.V(h + (y,)) for y, p in enumerate(self.pi[h]))

    def sequences(self):
        out, stack = [], [()]
        while stack:
            h = stack.pop()
            if self.terminal(h):
                out.append(h)
            else:
                stack.extend(h + (y,) for y in range(VOCAB))
        return sorted(out)

    def batch(self, value_fn=None) -> tuple:
        """A CreditBatch holding every complete sequence; values[b, t] = V(h_t), NaN beyond
        the last token (never read)."""
        V = value_fn or self.V
        seqs = self.sequences()
        B, T = len(seqs), HORIZON
        mask = torch.zeros(B, T, dtype=torch.bool)
        values = torch.full((B, T + 1), math.nan, dtype=torch.float64)
        for b, s in enumerate(seqs):
            mask[b, : len(s)] = True
            for t in range(len(s)):
                values[b, t] = V(s[:t])
        rewards = torch.tensor([self.reward(s) for s in seqs], dtype=torch.float64)
        batch = CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.zeros(B, dtype=torch.long), values=values)
        return batch, seqs


WORLDS = [pytest.param(False, id="fixed_length"), pytest.param(True, id="eos_padding")]


def _credit(batch, **cfg):
    return compute_credit("pact", batch, pact={"mode": "credit", **cfg}).advantages


def test_world_is_what_it_claims():
    fixed, eos = TabularWorld(False), TabularWorld(True)
    assert len(fixed.sequences()) == VOCAB**HORIZON
    lengths = {len(s) for s in eos.sequences()}
    assert lengths == {1, 2, 3}
    for w in (fixed, eos):
        for h, p in w.pi.items():
            assert abs(sum(p) - 1) < 1e-12 and min(p) > 0.01
        # sum over all sequences of P(sequence) * R = V(root)
        total = 0.0
        for s in w.sequences():
            prob = math.prod(w.pi[s[:t]][s[t]] for t in range(len(s)))
            total += prob * w.reward(s)
        assert abs(total - w.V(())) < 1e-12


@pytest.mark.parametrize("eos", WORLDS)
def test_credit_completeness(eos):
    w = TabularWorld(eos)
    batch, seqs = w.batch()
    c = _credit(batch)
    assert torch.isfinite(c).all() and (c[~batch.mask] == 0).all()
    torch.testing.assert_close(c.sum(1), batch.rewards - w.V(()), rtol=0, atol=1e-12)


@pytest.mark.parametrize("eos", WORLDS)
def test_credit_prefix_consistency(eos):
    w = TabularWorld(eos)
    batch, seqs = w.batch()
    c = _credit(batch)
    cum = c.cumsum(1)
    for b, s in enumerate(seqs):
        for t in range(len(s)):
            # cumulative credit through token t = V(h_{t+1}) - V(h_0), whatever follows
            assert abs(cum[b, t].item() - (w.V(s[: t + 1]) - w.V(()))) < 1e-12
    # two sequences sharing a prefix get identical credit on it
    shared = 0
    for (i, s), (j, u) in itertools.combinations(enumerate(seqs), 2):
        k = 0
        while k < min(len(s), len(u)) and s[k] == u[k]:
            k += 1
        if k:
            shared += 1
            assert torch.equal(c[i, :k], c[j, :k]), (s, u)
    assert shared > 10


def _neutrality_gaps(w, c, seqs):
    """For every non-terminal prefix h: sum_y pi(y | h) * c(h, y), read from the batch."""
    row_of = {}
    for b, s in enumerate(seqs):
        for t in range(len(s)):
            row_of.setdefault(s[: t + 1], b)
    gaps = {}
    for h, p in w.pi.items():
        gaps[h] = sum(p[y] * c[row_of[h + (y,)], len(h)].item() for y in range(VOCAB))
    return gaps


@pytest.mark.parametrize("eos", WORLDS)
def test_credit_neutrality(eos):
    w = TabularWorld(eos)
    batch, seqs = w.batch()
    gaps = _neutrality_gaps(w, _credit(batch), seqs)
    assert len(gaps) == len(w.pi) and len(gaps) > 3
    assert max(abs(g) for g in gaps.values()) < 1e-12


@pytest.mark.parametrize("eos", WORLDS)
def test_a_wrong_critic_keeps_completeness_but_breaks_neutrality(eos):
    # the telescoping makes completeness hold for any V; neutrality needs V = E[R | h]
    w = TabularWorld(eos)
    wrong = lambda h: 0.9 * w.V(h) + 0.05 * (len(h) % 2)  # noqa: E731
    batch, seqs = w.batch(value_fn=wrong)
    c = _credit(batch)
    torch.testing.assert_close(c.sum(1), batch.rewards - wrong(()), rtol=0, atol=1e-12)
    gaps = _neutrality_gaps(w, c, seqs)
    assert max(abs(g) for g in gaps.values()) > 1e-3


@pytest.mark.parametrize("eos", WORLDS)
def test_gae_mode_is_outcome_minus_value_of_each_prefix(eos):
    w = TabularWorld(eos)
    batch, seqs = w.batch()
    assert PACTConfig().mode == "gae" and PACTConfig().gamma == 1.0 and PACTConfig().lam == 1.0
    a = compute_credit("pact", batch).advantages
    for b, s in enumerate(seqs):
        for t in range(HORIZON):
            want = w.reward(s) - w.V(s[:t]) if t < len(s) else 0.0
            assert abs(a[b, t].item() - want) < 1e-12
    # the paper's advantage is the credit still to come: A_t = sum_{k >= t} c_k
    c = _credit(batch)
    torch.testing.assert_close(a, c.flip(1).cumsum(1).flip(1) * batch.fmask.double(), rtol=0, atol=1e-12)


def test_gae_mode_reuses_the_gae_recursion():
    b = make_batch(6, 7, 3, seed=4, lengths=[7, 2, 5, 0, 3, 6])
    for gamma, lam in [(0.9, 0.5), (1.0, 0.95)]:
        p = compute_credit("pact", b, pact={"gamma": gamma, "lam": lam}).advantages
        g = compute_credit("gae", b, gae={"gamma": gamma, "lam": lam, "whiten": False}).advantages
        torch.testing.assert_close(p, g)


masks_with_holes = st.integers(1, 4).flatmap(
    lambda B: st.integers(1, 6).flatmap(
        lambda T: st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=B, max_size=B)
    )
)


@settings(max_examples=30, deadline=None)
@given(mask=masks_with_holes, seed=st.integers(0, 10_000))
def test_holes_are_skipped_in_both_modes(mask, seed):
    B, T = len(mask), len(mask[0])
    gen = torch.Generator().manual_seed(seed)
    m = torch.tensor(mask, dtype=torch.bool)
    R = torch.rand(B, generator=gen, dtype=torch.float64)
    v = torch.rand(B, T + 1, generator=gen, dtype=torch.float64)
    v = torch.where(torch.cat([m, torch.zeros(B, 1, dtype=torch.bool)], 1), v, torch.nan)
    batch = CreditBatch(response_mask=m, rewards=R, group_ids=torch.zeros(B, dtype=torch.long), values=v)
    a = compute_credit("pact", batch).advantages
    c = _credit(batch)
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        for k, t in enumerate(idx):
            nxt = R[b].item() if k == len(idx) - 1 else v[b, idx[k + 1]].item()
            assert abs(c[b, t].item() - (nxt - v[b, t].item())) < 1e-12
            assert abs(a[b, t].item() - (R[b].item() - v[b, t].item())) < 1e-12
        if idx:
            assert abs(c[b].sum().item() - (R[b].item() - v[b, idx[0]].item())) < 1e-12
    assert (a[~m] == 0).all() and (c[~m] == 0).all()


@pytest.mark.parametrize("mode", ["gae", "credit"])
def test_finite_zero_on_mask_padding_invariant(mode):
    b = make_batch(8, 6, 4, seed=9, lengths=[3, 0, 6, 1, 2, 5, 6, 4], binary_rewards=False)
    out = compute_credit("pact", b, pact={"mode": mode})
    assert torch.isfinite(out.advantages).all() and (out.advantages[~b.mask] == 0).all()
    pad = compute_credit("pact", pad_batch(b, 2), pact={"mode": mode})
    torch.testing.assert_close(pad.advantages[:, :6], out.advantages)
    assert (pad.advantages[:, 6:] == 0).all()
    torch.testing.assert_close(out.returns, b.rewards.unsqueeze(1).expand(8, 6) * b.fmask)
    for k, v in out.metrics.items():
        assert k.startswith("pact/") and math.isfinite(v)


def test_reward_range_rescales_and_rejects_outside():
    b = make_batch(4, 5, 2, seed=1, binary_rewards=False)
    wide = b.replace(rewards=b.rewards * 4 - 2)  # in [-2, 2]
    for mode in ("gae", "credit"):
        torch.testing.assert_close(
            compute_credit("pact", wide, pact={"reward_range": [-2, 2], "mode": mode}).advantages,
            compute_credit("pact", b, pact={"mode": mode}).advantages,
        )
    assert PACTConfig(reward_range=[-2, 2]).reward_range == (-2.0, 2.0)
    with pytest.raises(CreditInputError, match="rewards.*reward_range"):
        compute_credit("pact", wide)


def test_pact_errors():
    with pytest.raises(CreditInputError, match="values"):
        CreditPipeline("pact")(make_batch(4, 5, 2, seed=0, signals=("logprobs",)))
    b = make_batch(4, 5, 2, seed=0)
    with pytest.raises(CreditInputError, match="values"):
        compute_credit("pact", b.replace(values=b.values + 1.5))
    for bad, field in [({"mode": "td"}, "mode"), ({"gamma": 2.0}, "gamma"), ({"lam": -1.0}, "lam"),
                       ({"reward_range": (1.0, 0.0)}, "reward_range"), ({"reward_range": 3}, "reward_range")]:
        with pytest.raises(ValueError, match=field):
            CreditPipeline("pact", pact=bad)


# ---- critic loss and importance weights ----------------------------------------------

def _loss_case():
    ln3 = math.log(3.0)
    logits = torch.tensor([[0.0, ln3, math.nan], [ln3, -ln3, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights = torch.tensor([[1.0, 0.5, 9.0], [2.0, 1.0, 0.0]], dtype=torch.float64)
    return logits, mask, weights


def test_critic_loss_hand_values_and_gradients():
    logits, mask, weights = _loss_case()
    loss = pact_critic_loss(logits, torch.tensor([1.0, 0.0], dtype=torch.float64), mask, weights)
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4; 5 valid tokens
    want = (1 * math.log(2) + 0.5 * -math.log(0.75) + 2 * math.log(4) + 1 * -math.log(0.75) + 0 * math.log(2)) / 5
    assert abs(loss.item() - want) < 1e-12
    loss.backward()
    # d/dx BCE = sigmoid(x) - y, times the weight, over the number of valid tokens
    want_grad = torch.tensor([[-0.5 / 5, 0.5 * -0.25 / 5, 0.0], [2 * 0.75 / 5, 0.25 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logits.grad, want_grad, rtol=0, atol=1e-12)


def test_critic_loss_unweighted_and_reward_range():
    logits, mask, _ = _loss_case()
    plain = pact_critic_loss(logits, torch.tensor([1.0, 0.0], dtype=torch.float64), mask)
    want = (math.log(2) - math.log(0.75) + math.log(4) - math.log(0.75) + math.log(2)) / 5
    assert abs(plain.item() - want) < 1e-12
    ranged = pact_critic_loss(logits, torch.tensor([2.0, -2.0], dtype=torch.float64), mask, reward_range=(-2, 2))
    assert abs(ranged.item() - want) < 1e-12
    with pytest.raises(CreditInputError, match="rewards"):
        pact_critic_loss(logits, torch.tensor([2.0, 0.0], dtype=torch.float64), mask)
    empty = pact_critic_loss(logits, torch.tensor([1.0, 0.0], dtype=torch.float64), torch.zeros(2, 3))
    assert empty.item() == 0.0


def test_critic_loss_errors():
    logits, mask, weights = _loss_case()
    r = torch.tensor([1.0, 0.0], dtype=torch.float64)
    with pytest.raises(CreditInputError, match="value_logits"):
        pact_critic_loss(logits[0], r, mask)
    with pytest.raises(CreditInputError, match="rewards"):
        pact_critic_loss(logits, r[:1], mask)
    with pytest.raises(CreditInputError, match="response_mask"):
        pact_critic_loss(logits, r, mask[:, :2])
    with pytest.raises(CreditInputError, match="weights"):
        pact_critic_loss(logits, r, mask, weights[:, :2])
    with pytest.raises(CreditInputError, match="weights"):
        pact_critic_loss(logits, r, mask, -weights)


def test_is_weights_hand_case():
    ratio = torch.tensor([[1.5, 3.0, 0.25], [0.6, 1.9, 1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, math.nan]], dtype=torch.float64)
    new = (old + ratio.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = pact_critic_is_weights(new, old, mask)  # defaults [0.5, 2]
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.0, 0.0], [0.6, 1.9, 0.0]], dtype=torch.float64))
    assert not w.requires_grad
    w2 = pact_critic_is_weights(new, old, mask, low=0.2, high=4.0)
    torch.testing.assert_close(w2, torch.tensor([[1.5, 3.0, 0.25], [0.6, 1.9, 0.0]], dtype=torch.float64))
    # bounds are inclusive: ratio exactly 1 survives low = high = 1, anything else is masked
    z = torch.zeros(1, 2, dtype=torch.float64)
    w3 = pact_critic_is_weights(z + torch.tensor([[0.0, 1e-9]], dtype=torch.float64), z, torch.ones(1, 2), low=1.0, high=1.0)
    assert w3.tolist() == [[1.0, 0.0]]
    # a huge increase gives an infinite ratio: masked, not inf
    w4 = pact_critic_is_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.ones(1, 1))
    assert w4.tolist() == [[0.0]]


def test_is_weights_feed_the_loss():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.log(torch.tensor([[1.2, 5.0, 0.8]], dtype=torch.float64))
    mask = torch.ones(1, 3)
    w = pact_critic_is_weights(new, old, mask)
    logits = torch.zeros(1, 3, dtype=torch.float64)
    loss = pact_critic_loss(logits, torch.tensor([1.0], dtype=torch.float64), mask, weights=w)
    assert abs(loss.item() - (1.2 + 0.0 + 0.8) * math.log(2) / 3) < 1e-12


def test_is_weights_errors():
    z = torch.zeros(2, 3)
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="low"):
        pact_critic_is_weights(z, z, m, low=1.5)
    with pytest.raises(ValueError, match="high"):
        pact_critic_is_weights(z, z, m, high=0.5)
    with pytest.raises(CreditInputError, match="old_logprobs"):
        pact_critic_is_weights(z, z[:, :2], m)
    with pytest.raises(CreditInputError, match="response_mask"):
        pact_critic_is_weights(z, z, torch.full((2, 3), 2))
    with pytest.raises(CreditInputError, match="new_logprobs"):
        pact_critic_is_weights(z + math.nan, z, m)
