"""ARCA's intrinsic baselines: the salience of each (surprisal, entropy reduction, divergence)
against the authors' code (rodlaf/tokenweighting, experiment/hf/token_weights.py).

The weighting they share with ARCA, their provenance, errors and padding invariance are tested
in tests/test_arca.py (parametrised over all four methods).
"""

from __future__ import annotations

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.credit.methods.intrinsic import entropy_reduction

from helpers import make_batch

NAN = float("nan")


def reference_weights(scores, mask, eps=1e-8, sharpening=1.0):
    """The authors' sum-1 weights: ``(score + eps) ** sharpening``, clamped at 0, masked, over
    the row sum floored at eps (written from ``build_token_weights``)."""
    s = scores.double() + eps
    if sharpening != 1.0:
        s = s.pow(sharpening)
    s = torch.where(mask.bool(), s.clamp(min=0.0), torch.zeros_like(s))
    return s / s.sum(-1, keepdim=True).clamp_min(eps)


def reference_code_entropy_drops(H):
    """The authors' entropy-reduction scores: the next column's entropy, last column 0."""
    nxt = torch.zeros_like(H)
    nxt[:, :-1] = H[:, 1:]
    drops = (H - nxt).clamp(min=0.0)
    drops[:, -1] = 0.0
    return drops


def entropy_batch():
    #            t:    0     1     2     3     4
    H = torch.tensor([[2.0, 1.0, 1.5, 0.5, NAN],    # padded after t = 3
                      [3.0, 1.0, 2.5, 0.0, 0.0],    # padded after t = 2; padding entropy 0
                      [1.0, 9.0, 0.25, 0.5, NAN],   # a hole at t = 1
                      [0.7, 0.3, 0.2, 0.1, 0.05]],  # full length
                     dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    return CreditBatch(response_mask=mask, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
                       group_ids=torch.zeros(4, dtype=torch.long), entropy=H)


def test_entropy_reduction_hand_case_with_padding_and_a_hole():
    b = entropy_batch()
    drops = entropy_reduction(b.entropy, b.mask)
    expected = torch.tensor([
        [1.0, 0.0, 1.0, 0.0, 0.0],    # 2-1, max(0, 1-1.5), 1.5-0.5, last valid token 0
        [2.0, 0.0, 0.0, 0.0, 0.0],    # 3-1, max(0, 1-2.5), last valid 0 (not 2.5 - padding's 0)
        [0.75, 0.0, 0.0, 0.0, 0.0],   # 1-0.25 across the hole, max(0, 0.25-0.5), last valid 0
        [0.4, 0.1, 0.1, 0.05, 0.0],   # full length: last column 0
    ], dtype=torch.float64)
    torch.testing.assert_close(drops, expected)
    # the calibrator weighs by the reduction, not by the raw entropy
    out = CreditPipeline("entropy")(b)
    n = b.mask.sum(1, keepdim=True)
    torch.testing.assert_close(out.token_weights, reference_weights(expected, b.mask) * n)
    torch.testing.assert_close(out.token_weights[0, :4], torch.tensor([2.0, 0.0, 2.0, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-6)
    assert torch.isfinite(out.advantages).all() and (out.advantages[~b.mask] == 0).all()


def test_entropy_reduction_equals_the_reference_code_on_unpadded_rows():
    gen = torch.Generator().manual_seed(2)
    H = torch.rand(6, 9, generator=gen, dtype=torch.float64) * 4
    full = torch.ones(6, 9, dtype=torch.bool)
    torch.testing.assert_close(entropy_reduction(H, full), reference_code_entropy_drops(H))
    # with right padding the two differ only at the last valid token of a shorter row, where
    # the reference code compares with the entropy of the padding position (docs/methods.md)
    mask = full.clone()
    mask[0, 5:] = False
    diff = (entropy_reduction(H, mask) - reference_code_entropy_drops(H)).abs() * mask
    assert diff[1:].max() == 0 and diff[0, :4].max() == 0


@pytest.mark.parametrize("name,score", [
    ("surprisal", lambda b: -b.logprobs),
    ("entropy", lambda b: reference_code_entropy_drops(b.entropy)),  # rows are full length here
    ("divergence", lambda b: (b.logprobs - b.ref_logprobs).abs()),
])
@pytest.mark.parametrize("sharpening", [1.0, 2.0])
def test_weights_are_the_reference_codes_times_length(name, score, sharpening):
    b = make_batch(8, 7, 4, seed=11, lengths=[7] * 8, dtype=torch.float64)
    out = CreditPipeline(name, **{name: {"sharpening": sharpening}})(b)
    expected = reference_weights(score(b), b.mask, sharpening=sharpening) * b.mask.sum(1, keepdim=True)
    torch.testing.assert_close(out.token_weights, expected)


def test_heavy_tailed_surprisal_is_not_clipped():
    # one token at p = 1e-6 among confident ones: the reference gives it ~5.8x the mean credit
    lp = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.9, 0.9, 1e-6], [0.5] * 6], dtype=torch.float64))
    b = CreditBatch(response_mask=torch.ones(2, 6), rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
                    group_ids=torch.zeros(2, dtype=torch.long), logprobs=lp)
    out = CreditPipeline("surprisal")(b)
    expected = reference_weights(-lp, b.mask) * 6
    assert expected[0, 5] > 5.0
    torch.testing.assert_close(out.token_weights, expected)
