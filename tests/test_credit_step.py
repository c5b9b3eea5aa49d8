"""The trainer-neutral credit step (``tokencredit.credit.spec``): ``CreditPipeline.estimate`` (the
driver's half: the controllers' step, the estimator) and ``CreditPipeline.calibrate`` (the
workers' half: the calibrators, the token-weights product) compose to ``CreditPipeline``'s whole
result; the verl worker's calibration is that same function; ``credit_batch`` builds the batch
from whatever signals a trainer has; the controllers' signals are declared (``state_signals``)."""

from __future__ import annotations

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.credit.batch import CreditInputError
from tokencredit.credit.spec import credit_batch

B, T = 6, 7
# two calibrators that weigh tokens (the product is tested), a stateful one with a moving state
SPECS = {
    "grpo+taco+stare": {"stare": {"adaptive": True, "H_target": 5.0}, "taco": {"alpha": 0.5}},
    "rloo+stare": {"stare": {"adaptive": True, "variant": "C2"}},
    "grpo+taco": {"taco": {"alpha": 0.5}},
}


def _signals():
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(B, T, dtype=torch.long)
    for i, n in enumerate([7, 5, 6, 3, 7, 4]):
        mask[i, n:] = 0
    lp = (-torch.rand(B, T, generator=g) * 4) * mask
    lp[0, 1] = lp[2, 3] = -9.0  # tail tokens: TACO weighs them
    ent = (torch.rand(B, T, generator=g) * 2 + 0.05) * mask
    ent[0, 1] = ent[2, 3] = 0.1
    return mask, {"logprobs": lp, "entropy": ent, "old_logprobs": lp + 0.01 * mask,
                  "token_ids": torch.randint(0, 50, (B, T), generator=g)}


def _batch():
    mask, sig = _signals()
    return CreditBatch(response_mask=mask, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
                       group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), **sig)


def _by_hand(spec: str, batch: CreditBatch):
    """The spec's credit written out: controllers step, estimator, each calibrator on the last
    advantages, token weights multiplied, padding zeroed."""
    p = CreditPipeline(spec, SPECS[spec])
    p.update_state(batch)
    out = p.estimator.fn(batch, p.configs[p.estimator.name])
    adv, w = out.advantages, out.token_weights
    for cal in p.calibrators:
        res = cal.fn(batch, adv, p.configs[cal.name], p.states.get(cal.name))
        adv = res.advantages
        if res.token_weights is not None:
            w = res.token_weights if w is None else w * res.token_weights
    m = batch.mask
    return adv * m, None if w is None else w * m, p.state_dict()


@pytest.mark.parametrize("spec", list(SPECS))
def test_estimate_then_calibrate_is_the_pipeline(spec):
    batch = _batch()
    whole = CreditPipeline(spec, SPECS[spec])
    out = whole(batch)  # the own trainer's and TokenCreditGRPOTrainer's call
    halves = CreditPipeline(spec, SPECS[spec])
    est = halves.estimate(batch, update_state=True)  # driver
    split = halves.calibrate(batch, est)  # worker
    torch.testing.assert_close(split.advantages, out.advantages, rtol=0, atol=0)
    assert (split.token_weights is None) == (out.token_weights is None)
    if out.token_weights is not None:
        torch.testing.assert_close(split.token_weights, out.token_weights, rtol=0, atol=0)
    assert split.metrics == out.metrics and halves.state_dict() == whole.state_dict()
    adv, w, state = _by_hand(spec, batch)
    torch.testing.assert_close(out.advantages, adv)
    assert whole.state_dict() == state
    if "taco" in spec and "stare" in spec:  # both weigh tokens: the weights are their product
        assert w is not None and out.token_weights is not None
        torch.testing.assert_close(out.token_weights, w)
        taco_only = CreditPipeline("grpo+taco", SPECS["grpo+taco"])(batch).token_weights
        assert not torch.allclose(out.token_weights, taco_only)  # STARE's factor is in it


@pytest.mark.parametrize("spec", ["grpo+taco+stare", "rloo+stare"])
def test_verl_worker_calibration_is_the_pipelines(spec):
    losses = pytest.importorskip("tokencredit.integrations.verl.losses")
    batch = _batch()
    want = CreditPipeline(spec, SPECS[spec])(batch)
    driver = CreditPipeline(spec, SPECS[spec])
    est = driver.estimate(batch, update_state=True)
    mask, signals = _signals()
    # verl hands the worker the driver's advantages (zero on padding) and its own signals
    adv, metrics = losses.calibrate(driver, mask, est.advantages * mask, {**signals, "values": None})
    torch.testing.assert_close(adv, want.advantages)
    assert {k: v for k, v in want.metrics.items() if k.startswith(("taco/", "stare/")) and "next" not in k
            and "controller" not in k} == {k: v for k, v in metrics.items() if k.startswith(("taco/", "stare/"))}


def test_credit_batch_takes_what_is_declared():
    mask, signals = _signals()
    p = CreditPipeline("grpo+taco+stare")
    cb = credit_batch(mask, {**signals, "values": None}, need=p.calibrator_signals)
    assert {k for k, v in cb.to_dict().items() if v is not None} == {"response_mask", "rewards", "group_ids", "logprobs", "entropy"}
    assert torch.equal(cb.group_ids, torch.arange(B)) and not cb.rewards.any()
    # integer signals keep their dtype; floating ones become float32
    cb = credit_batch(mask, {"token_ids": signals["token_ids"], "entropy": signals["entropy"].double()})
    assert cb.token_ids.dtype == torch.long and cb.entropy.dtype == torch.float32
    # a declared signal the trainer lacks is named by the method that reads it
    with pytest.raises(CreditInputError, match="entropy: method 'taco' needs this signal"):
        p.calibrate(credit_batch(mask, {"logprobs": signals["logprobs"]}), torch.zeros(B, T))


def test_state_signals_are_declared_and_enough():
    assert CreditPipeline("grpo+taco+stare").state_signals == {"entropy"}
    assert CreditPipeline("grpo+taco").state_signals == frozenset()
    assert CreditPipeline("sepa").state_signals == frozenset()  # reads the rewards and the mask
    batch = _batch()
    full = CreditPipeline("grpo+taco+stare", SPECS["grpo+taco+stare"])
    full.update_state(batch)
    # a driver that has only the declared signals steps the controllers the same
    mask, signals = _signals()
    part = CreditPipeline("grpo+taco+stare", SPECS["grpo+taco+stare"])
    part.update_state(credit_batch(mask, signals, need=part.state_signals))
    assert part.state_dict() == full.state_dict() and full.state_dict()["stare"]["W"] != 1.1


def test_one_credit_state_file_for_every_integration(tmp_path):
    import json

    from tokencredit.credit.spec import load_credit_state, save_credit_state

    a = CreditPipeline("grpo+stare", stare={"adaptive": True})
    a.update_state(_batch())
    p = save_credit_state(tmp_path / "credit_state.json", a)
    assert json.loads(p.read_text()) == {"spec": "grpo+stare", "state": a.state_dict()}
    b = CreditPipeline("grpo+stare", stare={"adaptive": True})
    load_credit_state(p, b)
    assert b.state_dict() == a.state_dict() != CreditPipeline("grpo+stare", stare={"adaptive": True}).state_dict()
    with pytest.raises(ValueError, match=r"credit state of spec 'grpo\+stare', expected 'rloo\+stare'"):
        load_credit_state(p, CreditPipeline("rloo+stare"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not a credit state file") as e:
        load_credit_state(tmp_path / "bad.json", b)
    assert "\n" not in str(e.value)
    # the verl plugin's tokencredit_state.json is the same file
    tct = pytest.importorskip("tokencredit.integrations.verl.trainer")
    c = CreditPipeline("grpo+stare", stare={"adaptive": True})
    (tmp_path / "global_step_1").mkdir()
    (tmp_path / "global_step_1" / tct.STATE_FILE).write_text(p.read_text())
    assert tct.load_credit_state(str(tmp_path / "global_step_1"), c) and c.state_dict() == a.state_dict()
