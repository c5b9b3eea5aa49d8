"""Common random numbers for the continuations of neighbouring prefixes (tokencredit.analysis.fidelity.crn): the
Gumbel-max draw samples the softmax, the noise is a function of (row, continuation, position),
continuations of h_t and h_{t+1} coincide once the first draws the response's own token, and on
the tabular world the estimate of c_t gets closer to the exact credit at the same M."""

from __future__ import annotations

import math

import pytest
import torch

from tokencredit.analysis.fidelity import build_estimates, credit_spans, sample_continuations, span_values
from tokencredit.analysis.fidelity.crn import gumbel_choice, gumbel_noise

from test_fidelity import DigitTokenizer, exact_values, world_reward, world_sampler, world_saved
from test_pact import HORIZON, TabularWorld


def test_the_gumbel_max_draw_samples_the_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]], dtype=torch.float64)
    n = 20000
    draws = torch.stack([gumbel_choice(logits, [(0, m, 3)], seed=7, temperature=0.7) for m in range(n)]).squeeze(1)
    p = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(draws, minlength=5).double() / n
    se = torch.sqrt(p * (1 - p) / n)
    assert ((freq - p).abs() < 4 * se).all(), (freq, p)
    # top-p: only the nucleus is drawn
    nucleus = torch.stack([gumbel_choice(logits, [(0, m, 3)], seed=7, top_p=0.5) for m in range(2000)])
    assert set(nucleus.flatten().tolist()) <= {0, 3}


def test_the_noise_is_a_function_of_row_continuation_and_position():
    a = gumbel_noise([(1, 2, 3), (1, 2, 4), (1, 3, 3), (2, 2, 3)], 50, seed=0)
    b = gumbel_noise([(1, 2, 3)], 50, seed=0)
    assert torch.equal(a[0], b[0])
    for i in range(1, 4):
        assert not torch.equal(a[0], a[i])
    assert not torch.equal(b, gumbel_noise([(1, 2, 3)], 50, seed=1))


def test_continuations_of_neighbouring_prefixes_coincide_after_the_responses_token():
    from tokencredit.testing import tiny_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer(seed=0)
    prompt = tok("12+", add_special_tokens=False)["input_ids"]
    M, t = 256, 1
    h_t = prompt + tok("3", add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # the response's next token: the policy's most likely one, so that some draws take it
        y = int(model(torch.tensor([h_t])).logits[0, -1].argmax())
    response = h_t[len(prompt):] + [y]
    h_next = h_t + [y]
    kw = dict(temperature=1.0, crn_seed=5)
    conts, _ = sample_continuations(model, tok, [h_t, h_next], M, [6, 5], crn_keys=[(0, t), (0, t + 1)], **kw)
    again, _ = sample_continuations(model, tok, [h_t, h_next], M, [6, 5], crn_keys=[(0, t), (0, t + 1)], **kw)
    assert conts == again  # the draws are a function of the keys, not of the global RNG state
    coupled = [m for m in range(M) if conts[0][m][:1] == [response[t]]]
    assert coupled and len(coupled) < M
    for m in coupled:  # same prefix from then on, same noise: the same continuation
        assert conts[0][m][1:] == conts[1][m][: len(conts[0][m]) - 1]
    assert sum(len(conts[1][m]) for m in coupled) >= 3 * len(coupled)  # not just an end token
    # without common random numbers the two sets are independent draws
    torch.manual_seed(0)
    free, _ = sample_continuations(model, tok, [h_t, h_next], M, [6, 5], temperature=1.0)
    assert sum(free[0][m][1:] == free[1][m][: len(free[0][m]) - 1] for m in coupled) < len(coupled)


def crn_world_sampler(world: TabularWorld, seed: int):
    """The tabular world's policy drawn with the Gumbel-max noise of (row, m, position)."""

    def sample(prefixes, M, budgets, share=True, keys=None):
        conts, n = [], 0
        for pre, (b, t) in zip(prefixes, keys):
            row = []
            for m in range(M):
                h, c = tuple(pre[1:]), []
                while not world.terminal(h):
                    logits = torch.log(torch.tensor(world.pi[h], dtype=torch.float64)).unsqueeze(0)
                    y = int(gumbel_choice(logits, [(b, m, len(h))], seed=seed)[0])
                    h, c = h + (y,), c + [y]
                row.append(c)
                n += len(c)
            conts.append(row)
        return conts, n

    return sample


def _c_error(est, exact):
    return torch.cat([(credit_spans(v) - credit_spans(x)) for v, x in zip(span_values(est), exact)])


@pytest.mark.parametrize("eos", [False, True], ids=["fixed_length", "eos_padding"])
def test_common_random_numbers_sharpen_the_true_credit_on_the_tabular_world(tmp_path, eos):
    """Same world, same M = 8: the credit from coupled continuations is closer to the exact
    credit than from independent ones (mean squared error over every position of every
    sequence, over 6 seeds), and the even and odd halves' credits disagree less."""
    world = TabularWorld(eos=eos, seed=3)
    mse = {False: 0.0, True: 0.0}
    half = {False: [], True: []}
    for seed in range(6):
        for crn in (False, True):
            saved, seqs = world_saved(world)
            sampler = crn_world_sampler(world, seed) if crn else world_sampler(world)
            est = build_estimates(saved, None, DigitTokenizer(), world_reward(world, seqs), tmp_path / f"{crn}{seed}.pt", M=8,
                                  temperature=1.0, max_new_tokens=HORIZON, seed=seed, progress=False, check=False,
                                  sampler=sampler, crn=crn)
            assert est["settings"].get("crn", False) is crn
            err = _c_error(est, exact_values(world, seqs))
            mse[crn] += float((err ** 2).mean()) / 6
            # the two halves' credits disagree less (the split-half reference's own noise)
            d = torch.cat([credit_spans(e) - credit_spans(o) for e, o in zip(span_values(est, "even"), span_values(est, "odd"))])
            half[crn].append(float((d ** 2).mean()))
    assert mse[True] < 0.8 * mse[False], mse
    assert sum(half[True]) < 0.9 * sum(half[False]), half  # measured: 0.85 (fixed length)
