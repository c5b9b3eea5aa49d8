"""optim.one_pass: with one epoch the update's forward gives the policy pass's signals; the
separate pass stays where the plan needs it (several epochs, hidden states)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tokencredit.engine.passes as passes
from tokencredit.credit.plan import plan_signals
from tokencredit.credit.spec import CreditPipeline
from test_trainer import _cfg, _trainer


def _record_passes(monkeypatch):
    seen = []
    real = passes.run_passes

    def spy(plan, *a, **k):
        seen.append(plan.passes)
        return real(plan, *a, **k)

    monkeypatch.setattr(passes, "run_passes", spy)
    return seen


def _step(tmp_path, one_pass, credit="taco", **kw):
    cfg = _cfg(tmp_path / str(one_pass), credit=credit, **kw)
    cfg.optim = dataclasses.replace(cfg.optim, one_pass=one_pass)
    cfg.rollout = dataclasses.replace(cfg.rollout, prompts_per_step=3, samples_per_prompt=4)  # groups with signal
    tr = _trainer(cfg)
    metrics = tr.train_step()
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return tr, metrics, grads


@pytest.mark.parametrize("credit", ["taco", "acpo"])  # entropy; mode_prob + logprobs
def test_one_pass_gives_the_same_loss_and_gradients_without_the_policy_pass(tmp_path, monkeypatch, credit):
    seen = _record_passes(monkeypatch)
    _, m2, g2 = _step(tmp_path, one_pass=False, credit=credit)
    assert seen and all("policy" in p for p in seen)  # the separate pass ran
    seen.clear()
    tr, m1, g1 = _step(tmp_path, one_pass=True, credit=credit)
    assert all("policy" not in p for p in seen)  # ... and here it did not
    assert tr.plan.policy  # (the plan does declare a policy pass)
    assert m1["grad_norm"] > 0.0
    for k in ("loss", "entropy", "grad_norm"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-7, msg=n)


def test_several_epochs_keep_the_separate_policy_pass(tmp_path, monkeypatch):
    seen = _record_passes(monkeypatch)
    _step(tmp_path, one_pass=True, ppo_epochs=2)
    assert seen and "policy" in seen[0]


def test_update_gives_follows_the_plan_declarations():
    plan = plan_signals(CreditPipeline("grpo+taco"), lora=False)
    assert passes.update_gives(plan, 1) == plan.policy and "logprobs" in plan.policy
    assert passes.update_gives(plan, 2) == ()
    # a plan keeping the policy's hidden states (a critic) keeps its pass
    critic = plan_signals(CreditPipeline("pact"), lora=False)
    assert critic.policy_hidden and passes.update_gives(critic, 1) == ()
    # a plan without a policy pass (GRPO: the rollout's log-probs) has nothing to give
    assert passes.update_gives(plan_signals(CreditPipeline("grpo"), lora=False), 1) == ()
