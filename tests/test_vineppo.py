"""VinePPO: the authors' estimator and step split (transcribed from McGill-NLP/VinePPO below),
the continuation pass on the tiny model, a trainer step, and the refusal where continuations
cannot be sampled."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tokencredit.credit.batch import CreditBatch
from tokencredit.engine.continuations import mc_step_values, sample_continuations
from tokencredit.credit.methods.vineppo import StepCuts, VinePPOConfig, split_steps, vineppo
from tokencredit.credit.plan import PlanError, plan_signals
from tokencredit.credit.registry import ContinuationPass
from tokencredit.credit.spec import CreditPipeline
from tokencredit.testing import tiny_model_and_tokenizer


# -- transcriptions of the authors' code (read, re-written for the test; not imported) ----------
def ref_gsm8k_split(solution, delimiter="\n", answer_prefix="\n#### "):
    """tasks/gsm8k.py GSM8K.split_solution_into_intermediate_steps."""
    if answer_prefix is None:
        body, answer = solution, None
    else:
        parts = solution.split(answer_prefix)
        if len(parts) < 2:
            body, answer = solution, None
        else:
            body, answer = parts
    steps = body.split(delimiter)
    first = None
    for i, st in enumerate(steps):
        if st.strip() != "":
            first = i
            break
    if first is not None and first > 0:
        steps = [delimiter.join(steps[: first + 1])] + steps[first + 1:]
    if answer is not None:
        last = None
        for i in range(len(steps) - 1, -1, -1):
            if steps[i].strip() != "":
                last = i
                break
        if last is None:
            last = 0
        steps = steps[:last] + [f"{delimiter.join(steps[last:])}{answer_prefix}{answer}"]
    assert delimiter.join(steps) == solution
    idx = [0]
    for i, st in enumerate(steps):
        idx.append(idx[-1] + len(st) + (0 if i == 0 else len(delimiter)))
    return idx


def ref_step_advantages(values, score, max_step):
    """math_episode_generator_with_mc_advantages.py: the values requested (value_idx 0 .. max_step
    of _create_value_estimation_requests), the backward fill and _compute_step_advantages."""
    n = len(values)  # one value per step's start state
    vals = [None] * (n + 1)
    max_step_idx = n - 2 if max_step is None else min(n - 2, max_step - 1)
    vals[0] = values[0]
    for step_idx in range(n):
        if step_idx > max_step_idx:
            break
        vals[step_idx + 1] = values[step_idx + 1]
    rewards = [0.0] * n
    rewards[-1] = score
    vals[-1] = 0.0
    for i in range(len(vals) - 2, -1, -1):
        if vals[i] is not None:
            break
        vals[i] = rewards[i] + vals[i + 1]
    return [rewards[i] + vals[i + 1] - vals[i] for i in range(n)]


def ref_whiten(adv, mask):
    """trainers/utils.py masked_whiten(shift_mean=True, unbiased_variance=True)."""
    mean = (adv * mask).sum() / mask.sum()
    var = (((adv - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (adv - mean) * torch.rsqrt(var + 1e-8)


TEXTS = [
    "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72",
    "\n\nFirst step.\n\nSecond step\n#### 5",
    "One line only",
    "a\n\n\nb\n#### 3\n#### 4",
    "\n#### 9",
    "x\ny\nz\n",
]


@pytest.mark.parametrize("text", [t for t in TEXTS if t.count("\n#### ") < 2])
def test_step_split_matches_the_authors(text):
    assert split_steps(text) == ref_gsm8k_split(text)
    assert split_steps(text, "\n", None) == ref_gsm8k_split(text, "\n", None)


def test_step_split_with_more_than_one_answer_prefix():
    # the authors' unpacking fails there and the trajectory is dropped; ours keeps the whole
    # text as the body (MATH's rule, documented)
    t = TEXTS[3]
    with pytest.raises(ValueError):
        ref_gsm8k_split(t)
    assert split_steps(t) == ref_gsm8k_split(t, "\n", None)


def _random_case(rng, B=5, T=9, max_steps=None):
    mask = torch.zeros(B, T, dtype=torch.bool)
    starts = torch.zeros(B, T)
    mc = torch.zeros(B, T)
    rewards = torch.tensor([float(rng.integers(0, 2)) for _ in range(B)])
    ref_tok = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        L = int(rng.integers(1, T + 1))
        mask[b, :L] = True
        cuts = sorted({0} | set(rng.choice(np.arange(1, L), size=int(rng.integers(0, L)), replace=False).tolist())) if L > 1 else [0]
        values = [float(rng.integers(0, 10)) / 9 for _ in cuts]
        ends = cuts[1:] + [L]
        for s, (a, e) in enumerate(zip(cuts, ends)):
            starts[b, a] = 1
            mc[b, a:e] = values[s] if max_steps is None or s <= max_steps else 0.0
        adv = ref_step_advantages(values, float(rewards[b]), max_steps)
        for s, (a, e) in enumerate(zip(cuts, ends)):
            ref_tok[b, a:e] = adv[s]
    cb = CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.arange(B), mc_values=mc, step_starts=starts)
    return cb, ref_tok


@pytest.mark.parametrize("max_steps", [None, 0, 1, 2, 20])
@pytest.mark.parametrize("whiten", [True, False])
def test_estimator_equals_the_authors(max_steps, whiten):
    rng = np.random.default_rng(7)
    for _ in range(20):
        cb, ref = _random_case(rng, max_steps=max_steps)
        if whiten:
            ref = ref_whiten(ref, cb.mask.double())
        ref = torch.where(cb.mask, ref, torch.zeros_like(ref))
        out = vineppo(cb, VinePPOConfig(max_steps=max_steps, whiten=whiten))
        torch.testing.assert_close(out.advantages.double(), ref, atol=1e-6, rtol=1e-6)


def test_step_advantages_telescope():
    """The property that defines the estimator: summed over a response's steps (one token each),
    A_s = V_{s+1} - V_s telescopes to R - V_0."""
    rng = np.random.default_rng(3)
    cb, _ = _random_case(rng, B=8, T=12)
    a = vineppo(cb, VinePPOConfig(max_steps=None, whiten=False)).advantages
    starts = cb.step_starts.bool() & cb.mask
    per_row = (a * starts).sum(1)
    torch.testing.assert_close(per_row, cb.rewards - cb.mc_values[:, 0], atol=1e-6, rtol=0)
    assert (starts.sum(1) > 1).any()  # some rows have several steps


def test_token_cuts_follow_the_first_character():
    # the step of each token is that of its first character: ".\nc" straddles steps 0 and 1 and
    # belongs to step 0 (the authors' char -> token map), so step 1 starts at "d"; the end token
    # (empty text) belongs to the last step
    toks = ["ab", ".\nc", "d", "\n", "e", "\n#### ", "7", ""]
    text = "".join(toks)
    assert split_steps(text) == ref_gsm8k_split(text) == [0, 3, 6, 15]  # "ab." | "\ncd" | "\ne\n#### 7"
    assert StepCuts("\n", "\n#### ")(toks) == [0, 2, 3]
    assert StepCuts("\n", None)(toks) == [0, 2, 3, 5]


# -- the continuation pass on the tiny model --------------------------------------------------
def _pass_case():
    model, tok = tiny_model_and_tokenizer(seed=0)
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prompts = [torch.randint(3, V, (4,), generator=g).tolist(), torch.randint(3, V, (3,), generator=g).tolist()]
    responses = [torch.randint(3, V, (6,), generator=g).tolist(), torch.randint(3, V, (3,), generator=g).tolist()]
    plan = ContinuationPass(cuts=lambda texts, lp: [0, 2, 3] if len(texts) > 3 else [0, 1], k=4)
    return model, tok, prompts, responses, plan


def _run(model, tok, prompts, responses, plan, rewards, seen=None):
    def sample(prefixes, k, budgets):
        out = sample_continuations(model, prefixes, k, budgets, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, temperature=1.0)
        if seen is not None:
            seen.append((prefixes, out))
        return out

    return mc_step_values(plan, prompts=prompts, responses=responses, decode=tok.decode, budget=8, sample=sample, rewards=rewards)


def test_continuation_values_are_means_of_k_scored_continuations_from_the_prefixes():
    model, tok, prompts, responses, plan = _pass_case()
    # a reward that depends only on the response's first two tokens: deterministic on any prefix of >= 2
    det = lambda b, rs: [float((r[0] * 7 + (r[1] if len(r) > 1 else 0)) % 5) for r in rs]  # noqa: E731
    seen = []
    torch.manual_seed(0)
    out = _run(model, tok, prompts, responses, plan, det, seen)
    mc, st = out["mc_values"], out["step_starts"]
    assert st[0].tolist() == [1, 0, 1, 1, 0, 0] and st[1].tolist() == [1, 1, 0, 0, 0, 0][: st.shape[1]]
    r0 = responses[0]
    assert float(mc[0, 3]) == det(0, [r0])[0] and float(mc[0, 5]) == det(0, [r0])[0]  # prefix of 3: exact
    assert float(mc[0, 2]) == det(0, [r0])[0]  # prefix of 2: exact too
    # the prefixes sampled: prompt + response[:p] for every cut, each k times
    prefixes, conts = seen[0]
    want = [prompts[0] + r0[:p] for p in (0, 2, 3)] + [prompts[1] + responses[1][:p] for p in (0, 1)]
    assert sorted(map(tuple, prefixes)) == sorted(map(tuple, want))
    assert all(len(c) == plan.k for c in conts)
    # V(h_0) is the mean of its k scored continuations
    i = prefixes.index(prompts[0])
    assert float(mc[0, 0]) == pytest.approx(np.mean(det(0, conts[i])))
    assert float(mc[0, 1]) == float(mc[0, 0])  # held across the step
    # seeded and deterministic
    torch.manual_seed(0)
    again = _run(model, tok, prompts, responses, plan, det)
    assert torch.equal(again["mc_values"], mc)


def test_plan_refuses_vineppo_where_continuations_cannot_run():
    # the TRL subclass and the verl plugin plan without continuations (as for oracle's true_values)
    with pytest.raises(PlanError, match=r"vineppo reads mc_values .* expected the own trainer"):
        plan_signals(CreditPipeline("vineppo"), lora=False)
    plan = plan_signals(CreditPipeline("vineppo"), lora=False, continuations=True)
    assert plan.passes == ("policy", "continuations") and plan.continuations.k == 9
    assert plan_signals(CreditPipeline("vineppo", {"vineppo": {"k": 3}}), lora=False, continuations=True).continuations.k == 3


def test_trainer_trains_a_step_with_vineppo(tmp_path):
    from test_trainer import _cfg, _trainer

    cfg = _cfg(tmp_path, "vineppo", steps=1, credit_args=("vineppo.k=2",))
    tr = _trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    m = tr.train_step()
    cb = tr._last_batch["credit_batch"]
    assert cb.mc_values is not None and bool((cb.step_starts[:, 0] == 1).all())
    assert torch.isfinite(tr._last_batch["credit"].advantages).all()
    assert "vineppo/steps_mean" in m
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
