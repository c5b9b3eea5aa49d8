"""HICRA and SEPA against the retrain project's code (teilomillet/retrain: advantages/credit.py,
advantages/planning.py, training/sepa.py), with references written per response from reading it,
and the planning-token detector on hand cases."""

from __future__ import annotations

import dataclasses

import math

import pytest
import torch

from tokencredit import CreditBatch, CreditPipeline
from tokencredit.credit.methods.hicra import DEFAULT_STRATEGIC_GRAMS, HICRAConfig, hicra, planning_mask_of
from tokencredit.credit.methods.sepa import SEPAConfig, SEPAController, sepa
from tokencredit.credit.plan import PlanError, plan_signals

from helpers import make_batch, pad_batch


# ---- the planning-token detector ---------------------------------------------------------


def test_planning_tokens_hand_cases():
    # "wait let me" from token 0 (tokens 0-2), then "let me check" from token 1 (tokens 1-3)
    assert planning_mask_of(["Wait", " let", " me", " check", "."]) == [1, 1, 1, 1, 0]
    # word boundaries: "awaited" does not contain the word "wait"
    assert planning_mask_of(["awaited", " let", " me", " go"]) == [0, 0, 0, 0]
    # sentencepiece / byte-level markers are spaces; case does not matter
    assert planning_mask_of(["\u2581Let", "\u2581me", "\u2581THINK", "\u2581now"]) == [1, 1, 1, 0]
    assert planning_mask_of(["\u0120the", "\u0120key", "\u0120is", "\u0120x"]) == [1, 1, 1, 0]
    # empty fragments (a bare space token) do not break a gram
    assert planning_mask_of(["Let", " ", "me", " ", "verify"]) == [1, 1, 1, 1, 1]
    assert planning_mask_of(["1", " +", " 2", "\n"]) == [0, 0, 0, 0]
    # fragments are joined with spaces, so a word split across tokens is not matched (as in
    # retrain), nor a gram wider than the window of max(5, longest gram in words) fragments
    assert planning_mask_of(["le", "t", " me", " think"]) == [0] * 4
    assert planning_mask_of(["let", " ", " ", " ", " ", " ", "me", " think"]) == [0] * 8
    assert planning_mask_of([], DEFAULT_STRATEGIC_GRAMS) == [] and planning_mask_of(["wait"], ()) == [0]


# ---- references, one response at a time (from retrain/advantages/credit.py) ---------------


def ref_hicra(advs, plan, alpha=0.2):
    return [a + alpha * abs(a) if m else a for a, m in zip(advs, plan)]


def ref_sepa_pool(s, plan, lam):
    lam = max(0.0, min(1.0, lam))
    if lam == 0.0:
        return list(s)
    s = [min(e, 50.0) for e in s]
    ex = [e for e, m in zip(s, plan) if m == 0]
    if not ex:
        return list(s)
    mu = sum(ex) / len(ex)
    return [e if m else lam * mu + (1 - lam) * e for e, m in zip(s, plan)]


def ref_gtpo(a, s, beta=0.1):
    if not s:
        return []
    if beta == 0.0:
        return [a] * len(s)
    s = [min(e, 50.0) for e in s]
    mh = sum(s) / len(s)
    if mh < 1e-7:
        return [a] * len(s)
    return [a * max(0.0, 1.0 + beta * (h / (mh + 1e-8) - 1.0)) for h in s]


def _rows(batch):
    return [batch.mask[b].nonzero().squeeze(1).tolist() for b in range(batch.batch_size)]


@pytest.mark.parametrize("seed", range(4))
def test_hicra_equals_retrain_per_response(seed):
    batch = make_batch(8, 7, 4, seed=seed, lengths=[7, 3, 0, 5, 1, 7, 6, 2], dtype=torch.float64)
    adv = CreditPipeline("grpo")(batch).advantages
    for alpha in (0.2, 0.7):
        out = hicra(batch, adv, HICRAConfig(alpha=alpha)).advantages
        for b, pos in enumerate(_rows(batch)):
            want = ref_hicra(adv[b, pos].tolist(), batch.planning_mask[b, pos].tolist(), alpha)
            assert out[b, pos].tolist() == pytest.approx(want, abs=1e-12)
        assert (out[~batch.mask] == 0).all()


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_sepa_equals_retrain_pooling_then_gtpo_weighting(seed, lam):
    batch = make_batch(8, 7, 4, seed=seed, lengths=[7, 3, 1, 5, 4, 7, 6, 2], dtype=torch.float64)
    pm = batch.planning_mask.clone()
    pm[3] = 1  # a response with no execution token: pooling leaves it alone
    batch = batch.replace(planning_mask=pm, logprobs=batch.logprobs.clone().index_fill_(1, torch.tensor([0]), -80.0))
    adv = CreditPipeline("grpo")(batch).advantages
    out = sepa(batch, adv, SEPAConfig(lam=lam)).advantages
    for b, pos in enumerate(_rows(batch)):
        s = (-batch.logprobs[b, pos]).tolist()  # token 0 has surprisal 80: capped at 50
        plan = batch.planning_mask[b, pos].tolist()
        want = ref_gtpo(float(adv[b, pos[0]]), ref_sepa_pool(s, plan, lam))
        assert out[b, pos].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    # padding changes nothing
    padded = sepa(pad_batch(batch, 2), torch.cat([adv, torch.full((8, 2), math.nan, dtype=adv.dtype)], 1), SEPAConfig(lam=lam))
    torch.testing.assert_close(padded.advantages[:, :7], out)


def test_sepa_pooling_flattens_execution_weights_and_keeps_planning_ones():
    # one response, A = 1: planning token 0 (surprisal 3), execution tokens 1, 2, 4 and 0.5
    lp = torch.tensor([[-3.0, -1.0, -2.0, -4.0, -0.5]], dtype=torch.float64)
    b = CreditBatch(response_mask=torch.ones(1, 5), rewards=torch.ones(1, dtype=torch.float64),
                    group_ids=torch.zeros(1, dtype=torch.long), logprobs=lp,
                    planning_mask=torch.tensor([[1, 0, 0, 0, 0]]))
    a = torch.ones(1, 5, dtype=torch.float64)
    w0 = sepa(b, a, SEPAConfig(lam=0.0)).token_weights[0]
    w1 = sepa(b, a, SEPAConfig(lam=1.0)).token_weights[0]
    # lam = 1: every execution token has the execution mean 1.875, so one weight for all of them
    assert float(w1[1:].max() - w1[1:].min()) < 1e-12 < float(w0[1:].max() - w0[1:].min())
    mean = (3.0 + 4 * 1.875) / 5
    assert float(w1[0]) == pytest.approx(1 + 0.1 * (3.0 / (mean + 1e-8) - 1))


def test_sepa_schedule_gate_and_state():
    c = SEPAController(SEPAConfig(steps=10, delay_steps=2, correct_rate_gate=0.5))
    failing = make_batch(4, 3, 2, seed=0).replace(rewards=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    passing = failing.replace(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    lams = []
    for batch in [failing] * 3 + [passing] * 4 + [failing] * 12:
        c.update(batch)
        lams.append(c.lam())
    # closed for 3 steps (25% correct < 50%); step 3 resolves its lambda before its own correct
    # rate opens the gate (retrain's order); then open for good: (step - 2) / 10, capped at 1
    assert lams[:4] == [0.0] * 4
    assert lams[4:9] == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6])
    assert lams[-1] == 1.0
    d = c.state_dict()
    c2 = SEPAController(c.config)
    c2.load_state_dict(d)
    assert c2.lam() == c.lam() and c2.state_dict() == d
    with pytest.raises(KeyError, match="sepa state"):
        c2.load_state_dict({"step": 1})
    # the pipeline steps the controller before the credit (STARE's order), replays do not
    pipe = CreditPipeline("sepa", sepa={"steps": 1, "delay_steps": 0, "correct_rate_gate": 0.0})
    out = pipe(passing)
    assert out.metrics["sepa/lambda"] == 0.0 and pipe.states["sepa"].step == 1  # step 0: (0 - 0) / 1
    assert pipe(passing).metrics["sepa/lambda"] == 1.0
    assert pipe(passing, update_state=False).metrics["sepa/lambda"] == 1.0
    assert pipe.states["sepa"].step == 2


def _word_tokenizer():
    """A real HF tokenizer whose tokens carry byte-level BPE's word marker (what SmolLM2's and
    Qwen's tokenizers decode a token to, one at a time, is the word with or without a space)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "Hmm,", "\u0120wait", "\u0120let", "\u0120me", "\u0120check", ":", "\u012012", "\u0120so"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>"), {w: i for i, w in enumerate(words)}


def test_the_passes_compute_the_planning_mask_from_the_decoded_tokens():
    from tokencredit.engine.passes import PassInputs, PassModels, run_passes
    from tokencredit.testing import tiny_model_and_tokenizer

    tok, ids = _word_tokenizer()
    rows = [["Hmm,", "\u0120wait", "\u0120let", "\u0120me", "\u0120check", ":", "\u012012"],
            ["\u0120so", "\u012012", "<pad>", "<pad>", "<pad>", "<pad>", "<pad>"]]
    resp = torch.tensor([[ids[w] for w in r] for r in rows])
    mask = torch.tensor([[1] * 7, [1, 1, 0, 0, 0, 0, 0]])
    plan = plan_signals(CreditPipeline("hicra"), lora=False)
    assert plan.passes == ()  # no model pass: the decoded tokens only
    inp = PassInputs(input_ids=resp, attention_mask=mask, prompt_len=0, response_ids=resp, response_mask=mask,
                     decode=tok.decode)
    out = run_passes(plan, PassModels(policy=tiny_model_and_tokenizer()[0]), inp, temperature=1.0, micro_batch_size=2)
    # "wait let me" and "let me check" match; the window from "Hmm," reaches "wait let me"
    assert out["planning_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"^planning_mask: expected PassInputs.decode"):
        run_passes(plan, PassModels(policy=tiny_model_and_tokenizer()[0]),
                   PassInputs(input_ids=resp, attention_mask=mask, prompt_len=0, response_ids=resp, response_mask=mask),
                   temperature=1.0, micro_batch_size=2)


@pytest.mark.parametrize("spec", ["hicra", "gtpo+sepa"])
def test_the_own_trainer_trains_on_the_planning_mask_of_its_rollouts(tmp_path, spec):
    """One step: the credit batch's planning mask is the detector on the step's tokens, decoded
    with the run's tokenizer. The tiny character model never writes a strategic gram, so its
    tokenizer decodes every single token to one ("the key is"): every valid token is planning."""
    from test_trainer import _cfg, _trainer

    cfg = _cfg(tmp_path, credit=spec)
    cfg.rollout = dataclasses.replace(cfg.rollout, prompts_per_step=3, samples_per_prompt=4)
    tr = _trainer(cfg)
    real = tr.tokenizer.decode
    tr.tokenizer.decode = lambda token_ids, **k: " the key is" if len(token_ids) == 1 else real(token_ids, **k)
    m = tr.train_step()
    cb = tr._last_batch["credit_batch"]
    assert torch.equal(cb.planning_mask.bool(), cb.mask)
    if spec == "hicra":
        assert m["hicra/planning_frac"] == 1.0
        grpo = CreditPipeline("grpo")(cb, update_state=False).advantages
        torch.testing.assert_close(tr._last_batch["credit"].advantages, grpo + 0.2 * grpo.abs())


def test_trls_trainer_trains_on_the_planning_mask_of_its_completions(tmp_path):
    """TokenCreditGRPOTrainer: the planning mask comes from TRL's completions decoded with its
    tokenizer (every token decodes to a gram here, as above); the advantages are the core's."""
    pytest.importorskip("trl")
    import test_trl

    trainer = test_trl._make(tmp_path, "hicra", config={})
    real = trainer._tokenizer.decode
    trainer._tokenizer.decode = lambda token_ids, **k: " the key is" if len(token_ids) == 1 else real(token_ids, **k)
    trainer.train()
    assert trainer.records
    for rec in trainer.records:
        b = rec["batch"]
        assert torch.equal(b.planning_mask.bool(), b.mask)
        torch.testing.assert_close(rec["out"]["advantages"].float(), CreditPipeline("hicra")(b, update_state=False).advantages.float())


def test_verl_refuses_a_planning_mask_spec_in_one_line():
    pytest.importorskip("verl")
    from tokencredit.integrations.verl.core import check_supported

    for spec in ("hicra", "gtpo+sepa"):
        with pytest.raises(ValueError) as ei:
            check_supported(CreditPipeline(spec))
        msg = str(ei.value)
        assert "planning_mask" in msg and "\n" not in msg, msg


def test_config_errors_name_the_field():
    for cls, kw, field in [(HICRAConfig, {"alpha": -0.1}, "hicra alpha"), (SEPAConfig, {"beta": -1.0}, "sepa beta"),
                           (SEPAConfig, {"steps": 1.5}, "sepa steps"), (SEPAConfig, {"lam": 2.0}, "sepa lam"),
                           (SEPAConfig, {"correct_rate_gate": 1.5}, "sepa correct_rate_gate")]:
        with pytest.raises(ValueError, match=field):
            cls(**kw)
    b = make_batch(4, 3, 2, seed=0)
    with pytest.raises(ValueError, match=r"planning_mask: expected 0/1 on valid positions, got 2"):
        b.replace(planning_mask=torch.full((4, 3), 2))
