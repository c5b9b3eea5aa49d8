"""Behaviour log-probs under top-p are those of the distribution the sampler drew from.

TRL issue #6789: with top-p (or top-k) vLLM's log-probs are renormalised over the truncated
support while the trainer's are over the whole vocabulary, so a rollout correction's ratio
carries the kept mass S of each position. tokencredit's HFRollout records the log-prob after
the warpers (``log_softmax`` of the temperature-scaled, nucleus-truncated logits): the
correction's reference distribution is then the sampler's. These tests measure the bias on the
tiny model before (the full-vocabulary recording of earlier versions) and after.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tokencredit.engine.forward import forward_response
from tokencredit.engine.rollout import HFRollout
from tokencredit.engine.signals import token_signals
from tokencredit.testing import tiny_model_and_tokenizer

PROMPTS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2*3="}],
]
TOP_P = 0.8


def _peaked_model(seed=1):
    """The tiny model with a peaked next-token distribution (the random one is near uniform, and
    a nucleus of 0.8 would then keep most of the vocabulary)."""
    model, tok = tiny_model_and_tokenizer(seed=seed, eos_bias=0.0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model, tok


def _nucleus_logprobs(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """log_softmax over the nucleus (the most probable tokens whose mass reaches top_p; -inf
    elsewhere), written out here independently of the warpers HFRollout uses."""
    p = torch.softmax(logits.double(), -1)
    srt, idx = p.sort(-1, descending=True)
    keep_sorted = (srt.cumsum(-1) - srt) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    return torch.log_softmax(logits.double().masked_fill(~keep, float("-inf")), -1)


def _trainer_logits(model, rb):
    """The trainer's forward over prompt + response (the update's ``forward_response``)."""
    with torch.no_grad():
        _, logits = forward_response(model, rb.input_ids, rb.attention_mask, rb.prompt_len)
    return logits.float()


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprob_is_log_softmax_of_the_warped_logits(sampler, temperature):
    """Every response token, both samplers: the recorded log-prob equals log_softmax of the
    temperature-scaled, nucleus-truncated logits of the trainer's forward, and exceeds the
    full-vocabulary log-prob by exactly -log S (S: the nucleus mass at that position)."""
    model, tok = _peaked_model()
    rb = HFRollout(model, tok, sampler=sampler).generate(PROMPTS, num_samples=8, max_new_tokens=6,
                                                         temperature=temperature, top_p=TOP_P, seed=0)
    assert rb.behaviour_distribution == "truncated"
    m = rb.response_mask.bool()
    scaled = _trainer_logits(model, rb) / temperature
    want = _nucleus_logprobs(scaled, TOP_P).gather(-1, rb.response_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(rb.behaviour_logprobs[m].double(), want[m], atol=1e-4, rtol=0)
    full = token_signals(_trainer_logits(model, rb), rb.response_ids, temperature=temperature, want=("logprobs",))["logprobs"]
    nucleus_mass = (torch.softmax(scaled.double(), -1) * _nucleus_logprobs(scaled, TOP_P).isfinite()).sum(-1)
    torch.testing.assert_close((rb.behaviour_logprobs - full)[m].double(), -nucleus_mass.log()[m], atol=1e-4, rtol=0)
    assert float(nucleus_mass[m].max()) < 0.99, "the fixture's nucleus should cut some mass at every position"


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
def test_top_p_one_and_greedy_record_the_full_distribution(sampler):
    """The defaults change nothing: top_p = 1 records log_softmax(logits / T) of the whole vocabulary
    ("full"); greedy reports temperature 1 ("full")."""
    model, tok = _peaked_model()
    for temperature in (0.7, 0.0):
        rb = HFRollout(model, tok, sampler=sampler).generate(PROMPTS, num_samples=4, max_new_tokens=6,
                                                             temperature=temperature, top_p=1.0, seed=0)
        assert rb.behaviour_distribution == "full"
        t = temperature or 1.0
        full = token_signals(_trainer_logits(model, rb), rb.response_ids, temperature=t, want=("logprobs",))["logprobs"]
        m = rb.response_mask.bool()
        torch.testing.assert_close(rb.behaviour_logprobs[m], full[m], atol=1e-4, rtol=0)


def test_top_p_bias_before_and_after():
    """6,000 first tokens of one prompt at top_p 0.8. The correction's reference distribution
    (exp of the recorded log-prob) against the sampler's (the empirical frequency of each drawn
    token): after the fix each token's frequency is within 4.5 standard errors of exp(recorded);
    the full-vocabulary recording of earlier versions ("before": the trainer's plain forward)
    under-states every kept token by the nucleus mass S, far outside that band.

    Measured here (tiny model, weights x20, T = 1, per drawn token): S = 0.809; reference /
    sampler: before mean 0.809 (98.7% outside [0.9, 1.1]), after 1.000 (3.4%, sampling noise;
    top_p = 1 control: 1.000, 15%); exp(trainer - behaviour): before 1 (the truncation
    invisible), after S = 0.809 on every token."""
    model, tok = _peaked_model()
    n = 6000
    rb = HFRollout(model, tok).generate(PROMPTS[:1], num_samples=n, max_new_tokens=1, temperature=1.0, top_p=TOP_P, seed=0)
    first = rb.response_ids[:, 0]
    after = rb.behaviour_logprobs[:, 0].double()
    before = token_signals(_trainer_logits(model, rb)[:, :1], rb.response_ids[:, :1], want=("logprobs",))["logprobs"][:, 0].double()

    freq = torch.bincount(first, minlength=len(tok)).double() / n
    drawn = torch.unique(first)
    q_after = torch.zeros(len(tok), dtype=torch.float64).index_put_((first,), after.exp())
    q_before = torch.zeros(len(tok), dtype=torch.float64).index_put_((first,), before.exp())
    assert len(drawn) >= 3, "the fixture's nucleus should hold several tokens"
    assert abs(float(q_after[drawn].sum()) - 1.0) < 1e-4, "the drawn tokens are the whole nucleus: their recorded mass is 1"
    S = float(q_before[drawn].sum())  # the nucleus mass under the full distribution
    assert S < 0.9

    se = (q_after[drawn] * (1 - q_after[drawn]) / n).sqrt()
    z_after = ((freq[drawn] - q_after[drawn]).abs() / se).max()
    z_before = ((freq[drawn] - q_before[drawn]).abs() / se).max()
    assert z_after <= 4.5, float(z_after)
    assert z_before > 4.5, float(z_before)  # the old recording is measurably not the sampler's distribution

    ref_over_sampler_after = (q_after[drawn] / freq[drawn]).mean()
    ref_over_sampler_before = (q_before[drawn] / freq[drawn]).mean()
    assert abs(float(ref_over_sampler_after) - 1.0) < 0.05
    assert float(ref_over_sampler_before) == pytest.approx(S, abs=0.05)
    # the IS ratio of the trainer's full-vocabulary forward over the recorded behaviour log-prob
    ratio_after = (before - after).exp()
    torch.testing.assert_close(ratio_after, torch.full_like(ratio_after, S), atol=1e-4, rtol=0)


def test_the_own_trainer_takes_its_old_logprobs_from_the_update_under_top_p(tmp_path):
    """Under top-p the sampler's log-probs are the nucleus-renormalised ones, so the PPO ratio's old
    log-probs must come from the update's own (full-vocabulary) forward: the plan gains the policy
    log-prob pass, the logged log-ratio old - behaviour is log S < 0 on every token (the
    truncation, seen by the mismatch metrics), and the first epoch clips nothing."""
    from test_trainer import _cfg, _trainer

    cfg = _cfg(tmp_path, "grpo", steps=1)
    cfg.rollout = dataclasses.replace(cfg.rollout, top_p=TOP_P)
    cfg.log = dataclasses.replace(cfg.log, save_rollouts=False)
    tr = _trainer(cfg)
    assert "logprobs" in tr.plan.policy
    seen = []
    real = tr.rollout.generate
    tr.rollout.generate = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    m = tr.train_step()
    assert seen and all(rb.behaviour_distribution == "truncated" for rb in seen)
    assert m["rollout_corr/log_ratio_max"] < 1e-4 and m["rollout_corr/log_ratio_mean"] < -1e-3
    assert m["clip_ratio/region_mean"] == 0.0

    cfg1 = _cfg(tmp_path / "p1", "grpo", steps=1)
    assert "logprobs" not in _trainer(cfg1).plan.policy  # the default adds no pass
