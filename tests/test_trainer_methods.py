"""What the own trainer does for particular methods: STARE's controller order, PACT's critic
step, the loss aggregation a method's paper defines (ARCA, Dr. GRPO)."""

from __future__ import annotations

import json

import pytest
import torch

from tokencredit.train.config import LossConfig, load_config
from tokencredit.engine.forward import forward_response
from tokencredit.credit.losses import get_policy_loss
from tokencredit.engine.signals import token_signals
from tokencredit.credit.spec import CreditPipeline
from tokencredit.train.update import policy_loss_config

from test_trainer import _cfg, _metrics, _trainer


def test_stare_controller_steps_before_the_update_and_logs(tmp_path):
    # adaptive STARE with the gate on (the tiny model's entropy is far below 100): the step's
    # credit must read W after this step's controller step (reference order), and the
    # controller's own metrics must reach metrics.jsonl
    cfg = _cfg(tmp_path, "stare", steps=2, credit_args=("stare.adaptive=true", "stare.H_target=100.0"))
    tr = _trainer(cfg)
    tr.train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["stare/W"] for r in m] == pytest.approx([1.11, 1.12])
    assert [r["stare/W_next"] for r in m] == pytest.approx([1.11, 1.12])
    assert [r["stare/controller_step"] for r in m] == [1.0, 2.0]
    # the saved state is the one the last step's credit was computed with: a replay equals it
    last = tr._last_batch
    replay = CreditPipeline(tr.credit.name, tr.credit.configs)
    replay.load_state_dict(last["credit_state"])
    torch.testing.assert_close(replay(last["credit_batch"], update_state=False).advantages, last["credit"].advantages)


def _pact_step(tmp_path, monkeypatch, credit_args):
    import tokencredit.credit.methods.pact as pact_mod

    cfg = _cfg(tmp_path, "pact", steps=1, credit_args=credit_args)
    cfg.optim.lr = 5e-2  # a large step, so that pi_new differs visibly from pi_old
    tr = _trainer(cfg)
    seen = {}
    original_loss = pact_mod.pact_critic_loss

    def loss_spy(logits, rewards, mask, weights=None, **kw):
        seen["weights"] = weights.detach().clone()
        return original_loss(logits, rewards, mask, weights=weights, **kw)

    monkeypatch.setattr(pact_mod, "pact_critic_loss", loss_spy)
    inputs = []
    forward = tr.critic.forward
    tr.critic.forward = lambda x: inputs.append(x.detach().clone()) or forward(x)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    b = tr._last_batch["batch"]
    mask = b.response_mask.bool()
    tr.model.eval()
    with torch.no_grad():
        h_new, logits = forward_response(tr.model, b.input_ids, b.attention_mask, b.prompt_len, hidden=True)
    new_lp = token_signals(logits, b.response_ids, temperature=1.0, want=("logprobs",))["logprobs"]
    old_lp = tr._last_batch["credit_batch"].logprobs
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    return tr, seen, inputs, mask, h_new, new_lp, old_lp


def test_pact_critic_is_weighted_by_the_updated_actor_and_masks_outside_the_range(tmp_path, monkeypatch):
    tr, seen, inputs, mask, h_new, new_lp, old_lp = _pact_step(
        tmp_path, monkeypatch, ("pact.is_low=0.7", "pact.is_high=1.5")
    )
    ratio = torch.exp(new_lp - old_lp)
    inside = mask & (ratio >= 0.7) & (ratio <= 1.5)
    # the case must exercise both sides: tokens kept with a ratio != 1 and tokens masked
    assert inside.any() and (mask & ~inside).any()
    assert (ratio[inside] - 1).abs().max() > 1e-3
    want = torch.where(inside, ratio, torch.zeros_like(ratio))
    torch.testing.assert_close(seen["weights"], want, atol=1e-5, rtol=1e-4)
    m = json.loads((tr.out / "metrics.jsonl").read_text().splitlines()[-1])
    assert m["critic/is_kept_frac"] == pytest.approx(float(inside.sum() / mask.sum()))


def test_pact_critic_trains_on_the_updated_actors_hidden_states(tmp_path, monkeypatch):
    tr, seen, inputs, mask, h_new, new_lp, old_lp = _pact_step(tmp_path, monkeypatch, ())
    # the last critic call is the critic step; it reads the updated actor's states, not the
    # pre-update ones the credit's values came from (the first call)
    torch.testing.assert_close(inputs[-1], h_new[:, :-1], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(inputs[0][:, :-1], h_new[:, :-1], atol=1e-3)


def test_a_methods_paper_aggregation_is_the_default_and_the_user_wins():
    ppo = get_policy_loss("ppo")
    # Dr. GRPO: seq-mean-token-sum-norm with the generation budget as the constant
    got = policy_loss_config(ppo, LossConfig(), CreditPipeline("dr_grpo"), 48)
    assert (got.agg_mode, got.norm_constant) == ("seq-mean-token-sum-norm", 48.0)
    got = policy_loss_config(ppo, LossConfig(norm_constant=10.0), CreditPipeline("dr_grpo"), 48)
    assert (got.agg_mode, got.norm_constant) == ("seq-mean-token-sum-norm", 10.0)
    got = policy_loss_config(ppo, LossConfig(agg_mode="token-mean"), CreditPipeline("dr_grpo"), 48)
    assert got.agg_mode == "token-mean"
    # ARCA: per-trajectory length normalisation (the paper's estimator), in any pairing
    for spec in ("arca", "rloo+arca"):
        assert policy_loss_config(ppo, LossConfig(), CreditPipeline(spec), 48).agg_mode == "seq-mean-token-mean"
    assert policy_loss_config(ppo, LossConfig(agg_mode="token-sum"), CreditPipeline("arca"), 48).agg_mode == "token-sum"
    # methods without a declared aggregation keep the loss's own
    assert policy_loss_config(ppo, LossConfig(), CreditPipeline("grpo+taco"), 48).agg_mode == "token-mean"
    # two papers' aggregations in one spec: the user must choose
    with pytest.raises(ValueError, match=r"dr_grpo\+arca.*loss.agg_mode"):
        policy_loss_config(ppo, LossConfig(), CreditPipeline("dr_grpo+arca"), 48)
    assert policy_loss_config(ppo, LossConfig(agg_mode="token-mean"), CreditPipeline("dr_grpo+arca"), 48).agg_mode == "token-mean"


def test_the_cli_trains_arca_with_per_sequence_aggregation(tmp_path):
    cfg = load_config(None, ["--credit", "arca", "--model.lora"])
    tr_cfg = policy_loss_config(get_policy_loss(cfg.loss.policy_loss), cfg.loss, CreditPipeline(cfg.credit), cfg.rollout.max_new_tokens)
    assert tr_cfg.agg_mode == "seq-mean-token-mean"
