"""The two-level inverse-transform draw (``rollout.inverse_cdf_choice``): the same token as a full
float64 running sum over the vocabulary, and never a zero-probability token where the block's own
running sum rounds below its block sum."""

import pytest
import torch

from tokencredit.engine.rollout import inverse_cdf_choice


def _full_running_sum(probs, u):
    """The earlier form: one float64 running sum over the whole row."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    v = (1.0 - u.to(torch.float64)).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, v).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


@pytest.mark.parametrize("V,scale", [(49152, 3.0), (49152, 15.0), (1000, 3.0), (1500, 8.0), (7, 1.0)])
def test_blocks_draw_the_tokens_of_a_full_running_sum(V, scale):
    g = torch.Generator().manual_seed(V)
    probs = torch.softmax(torch.randn(32, V, generator=g) * scale, -1)  # float32, as the sampler gets them
    for _ in range(20):
        u = torch.rand(32, generator=g)
        assert torch.equal(inverse_cdf_choice(probs, u), _full_running_sum(probs, u))
    # u's top end, and a row whose mass sits in the last, partly padded block
    probs[0].zero_()
    probs[0, -1] = 1.0
    for u0 in (0.5, 1.0 - 2**-24):
        u = torch.full((32,), u0)
        assert torch.equal(inverse_cdf_choice(probs, u), _full_running_sum(probs, u))
    # u = 0 targets the total itself: where a row's tail is below float64's step at the total, the
    # forms may pick different tail tokens (both of probability < 1e-16 of the total), never a zero one
    tok = inverse_cdf_choice(probs, torch.zeros(32))
    assert bool((probs.gather(-1, tok[:, None]) > 0).all())


def test_a_block_whose_running_sum_rounds_low_never_draws_a_zero_probability_token():
    """1 followed by 32 entries of 2^-53: summed one after another in float64 each add rounds back
    to 1, summed in lanes (torch's sum) the block's total is above 1. The target at u = 0 is that
    total, beyond the block's running sum: the draw stays on the block's last nonzero entry."""
    p = torch.zeros(1, 64)
    p[0, 0] = 1.0
    p[0, 1:33] = 2.0**-53
    assert p.sum(-1, dtype=torch.float64).item() > p.cumsum(-1, dtype=torch.float64)[0, -1].item()  # the premise
    for block in (64, 512):
        tok = inverse_cdf_choice(p, torch.tensor([0.0]), block=block).item()
        assert p[0, tok] > 0, (block, tok)
