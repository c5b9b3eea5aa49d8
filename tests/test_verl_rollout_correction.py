"""Rollout correction in the verl plugin (issue 32.3): verl 0.9.1's own helper applies, so the
plugin defers to ``algorithm.rollout_correction`` (verl computes the TIS weights and the MIS mask
on the driver, ``compute_rollout_correction_and_add_to_batch``, and its engine loss hands
``rollout_is_weights`` to the policy loss). What the plugin must do is pass them on: the
``tokencredit`` policy loss hands them to verl's base loss with the calibrated advantages.
(tests/test_methods_round3b.py checks verl's helper against tokencredit's function.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")

from test_verl import actor_config, grpo_advantages, policy_tensors, rollout  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402

from tokencredit.integrations import verl as tcv  # noqa: E402


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch):
    monkeypatch.delenv(tcv.ENV_VAR, raising=False)
    tcv.install_settings(None)
    yield
    tcv.install_settings(None)


def _loss_and_grad(name, old, logp, adv, mask, weights):
    x = logp.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn(name)(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                                       loss_agg_mode="token-mean", config=actor_config(), rollout_is_weights=weights)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
def test_the_plugins_loss_applies_verls_rollout_is_weights(rollout_is):
    """verl's TIS weights for a sampler 0.7 nats off on every third token: the ``tokencredit`` loss
    (spec grpo, base vanilla) with them equals verl's vanilla loss with them, loss and gradient,
    and differs from the loss without them."""
    tlr, mask, uid, _ = rollout()
    adv = grpo_advantages(tlr, mask, uid)
    logp, old = policy_tensors(mask)
    behaviour = (old - 0.7 * (torch.arange(mask.shape[1]) % 3 == 1)) * mask
    corrected, _, _ = compute_rollout_correction_and_rejection_mask(old, behaviour, mask, rollout_is=rollout_is,
                                                                    rollout_is_threshold=2.0)
    w = corrected.batch["rollout_is_weights"]
    assert float((w[mask.bool()] - 1).abs().max()) > 0.5  # the weights are far from 1 somewhere
    tcv.install_settings(tcv.settings_from_dict({"spec": "grpo"}))
    ours, g_ours = _loss_and_grad("tokencredit", old, logp, adv, mask, w)
    plain, _ = _loss_and_grad("tokencredit", old, logp, adv, mask, None)
    tcv.install_settings(None)
    verls, g_verl = _loss_and_grad("vanilla", old, logp, adv, mask, w)
    torch.testing.assert_close(ours, verls, rtol=0, atol=0)
    torch.testing.assert_close(g_ours, g_verl, rtol=0, atol=0)
    assert abs(float(ours - plain)) > 1e-4
