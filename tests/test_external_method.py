"""The trainers know passes, not methods (issue 11, item 7): a toy estimator that declares an
extra pass (an oracle prompt of its own, scored by the policy) and a toy calibrator that declares
a signal (entropy), registered here, outside the package, run through tokencredit's own trainer
and through ``TokenCreditGRPOTrainer`` without either being edited. Each test checks that the
declared pass ran on the declared prompt (the prompt function was called for every row and the
oracle log-probs that reached the estimator equal an independent forward on that prompt) and that
the calibrator saw the declared signal (equal to an independent forward's entropy).

The toy methods are registered for this module only (a module fixture on a copy of the registry,
restored afterwards), so that the registry-wide tests (``test_contract``'s case for every
calibrator, ``test_properties``) never see them, whatever order the suite runs in."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import tokencredit as tc
from tokencredit.credit import registry
from tokencredit.credit.registry import CreditOutput, OraclePass, register_calibrator, register_estimator
from tokencredit.credit.spec import CreditPipeline
from tokencredit.testing import tiny_model_and_tokenizer

EST, CAL = "ext_toy_oracle", "ext_toy_entropy"  # unique names: the registry refuses duplicates
SPEC = f"{EST}+{CAL}"

PROMPT_CALLS: list = []  # (question, answer) of every call of the declared prompt function
SEEN: dict = {"est": [], "cal": []}  # the CreditBatch each toy method received


def _toy_text(question: str, answer: str) -> str:
    return f"Known answer: {answer}. Question: {question}"


def toy_prompt(question: str, answer: str) -> str:
    PROMPT_CALLS.append((question, answer))
    return _toy_text(question, answer)


@dataclass
class ToyOracleConfig:
    scale: float = 1.0  # weight of the oracle's evidence (toy)


@dataclass
class ToyEntropyConfig:
    gamma: float = 0.5  # w = exp(-gamma * entropy) (toy)


def toy_oracle(batch, config):
    """A_t = (r - mean of its group) + scale * (oracle_logprobs - logprobs), 0 on padding."""
    SEEN["est"].append(batch)
    r, g = batch.rewards, batch.group_ids
    centred = r - torch.stack([r[g == x].mean() for x in g])
    evidence = torch.where(batch.mask, batch.oracle_logprobs - batch.logprobs, 0.0)
    adv = torch.where(batch.mask, centred.unsqueeze(1) + config.scale * evidence, 0.0)
    return CreditOutput(advantages=adv, metrics={f"{EST}/evidence_mean": float(evidence[batch.mask].mean())})


def toy_entropy(batch, advantages, config, state):
    """A'_t = A_t * exp(-gamma * H_t)."""
    SEEN["cal"].append(batch)
    w = torch.where(batch.mask, torch.exp(-config.gamma * batch.entropy), 1.0)
    return CreditOutput(advantages=advantages * w, token_weights=w, metrics={f"{CAL}/weight_mean": float(w[batch.mask].mean())})


@pytest.fixture(scope="module", autouse=True)
def toy_methods():
    tc.list_methods()  # load the built-in methods into the registry before it is copied
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        register_estimator(
            EST, config=ToyOracleConfig, requires=("oracle_logprobs", "logprobs"), provenance="reconstructed",
            summary="toy: group-centred reward plus the evidence of an oracle prompt of its own",
            oracle=lambda c: OraclePass(prompt=toy_prompt, scorer="policy"),
        )(toy_oracle)
        register_calibrator(
            CAL, config=ToyEntropyConfig, requires=("entropy",), provenance="reconstructed",
            summary="toy: damps credit where the policy is uncertain", paired_with=EST,
        )(toy_entropy)
        yield
    assert EST not in tc.list_methods()  # restored


@pytest.fixture(autouse=True)
def _fresh_records():
    PROMPT_CALLS.clear()
    SEEN["est"].clear()
    SEEN["cal"].clear()


@torch.no_grad()
def _response_signals(model, prompt_ids, response_ids, temperature):
    """log-probs of ``response_ids`` after ``prompt_ids`` (one unpadded row) and the entropy, by a
    plain forward."""
    ids = torch.cat([prompt_ids, response_ids]).unsqueeze(0)
    T = response_ids.shape[0]
    logits = model(input_ids=ids).logits[0, -T - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _check_credit(batch, advantages, est_saw, cal_saw):
    """The toy methods received this batch with the declared signals, and the credit is theirs."""
    assert est_saw is batch and cal_saw is batch
    assert batch.oracle_logprobs is not None and batch.entropy is not None
    m = batch.mask
    assert not torch.allclose(batch.oracle_logprobs[m], batch.logprobs[m])  # the oracle prompt mattered
    core = CreditPipeline(SPEC)(batch, update_state=False).advantages
    torch.testing.assert_close(advantages, core)
    est_only = CreditPipeline(EST)(batch, update_state=False).advantages
    assert not torch.allclose(advantages, est_only)  # the calibrator acted


# -- tokencredit's own trainer --------------------------------------------------------------
def test_own_trainer_runs_the_declared_pass_and_signal(tmp_path):
    from test_trainer import _cfg

    from tokencredit.data.tasks import make_task
    from tokencredit.train.trainer import Trainer

    class Spy(Trainer):
        """Recomputes, when the trainer computes its signals (before the update), the oracle
        log-probs on the toy prompt and the entropy, one unpadded row at a time."""

        def _signals(self, batch, plan):
            sig = super()._signals(batch, plan)
            was = self.model.training
            self.model.eval()
            rows = []
            for i in range(len(batch)):
                ex = batch.examples[int(batch.prompt_index[i])]
                msgs = [dict(x) for x in ex.messages]
                msgs[-1]["content"] = _toy_text(ex.question, ex.answer)
                text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                o_ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
                p_ids = batch.input_ids[i, : batch.prompt_len][batch.attention_mask[i, : batch.prompt_len].bool()]
                oracle, _ = _response_signals(self.model, o_ids.to(p_ids.device), batch.response_ids[i], 1.0)
                _, ent = _response_signals(self.model, p_ids, batch.response_ids[i], 1.0)
                rows.append((oracle, ent))
            self.model.train(was)
            self.checked.append(
                {"sig": sig, "oracle": torch.stack([r[0] for r in rows]), "entropy": torch.stack([r[1] for r in rows]),
                 "questions": [(batch.examples[int(j)].question, batch.examples[int(j)].answer) for j in batch.prompt_index]}
            )
            return sig

    cfg = _cfg(tmp_path, SPEC, steps=1)
    assert cfg.rollout.temperature == 1.0
    model, tok = tiny_model_and_tokenizer(seed=0)
    task = make_task(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval, reward_fn=cfg.task.reward_fn)
    tr = Spy(cfg, model=model, tokenizer=tok, task=task)
    tr.checked = []
    assert tr.plan.passes == ("policy", "oracle")  # derived from the declarations alone
    tr.train()

    assert len(tr.checked) == 1
    rec = tr.checked[0]
    cb = tr._last_batch["credit_batch"]
    m = cb.mask
    assert sorted(PROMPT_CALLS) == sorted(rec["questions"])  # the declared prompt, once per row
    est_saw, cal_saw = SEEN["est"][-1], SEEN["cal"][-1]
    torch.testing.assert_close(cb.oracle_logprobs[m], rec["oracle"][m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cb.entropy[m], rec["entropy"][m], atol=1e-4, rtol=1e-4)
    _check_credit(cb, tr._last_batch["credit"].advantages, est_saw, cal_saw)


# -- TokenCreditGRPOTrainer --------------------------------------------------------------------
def test_trl_trainer_runs_the_declared_pass_and_signal(tmp_path):
    pytest.importorskip("trl")
    from test_trl import TEMPERATURE, RewardLog, _args, _dataset

    from tokencredit.integrations.trl import TokenCreditGRPOTrainer

    class Spy(TokenCreditGRPOTrainer):
        """Recomputes, at each generation (the weights the signals were computed with), the
        oracle log-probs on the toy prompt and the entropy, one unpadded row at a time."""

        def _generate_and_score_completions(self, inputs):
            PROMPT_CALLS.clear()
            out = super()._generate_and_score_completions(inputs)
            model, tok = self.accelerator.unwrap_model(self.model), self.processing_class
            rows = []
            for i, x in enumerate(inputs):
                conv = [{"role": "user", "content": _toy_text(x["prompt"][-1]["content"], x["answer"])}]
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                o_ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
                p_ids = out["prompt_ids"][i][out["prompt_mask"][i].bool()]
                oracle, _ = _response_signals(model, o_ids, out["completion_ids"][i], TEMPERATURE)
                _, ent = _response_signals(model, p_ids, out["completion_ids"][i], TEMPERATURE)
                rows.append((oracle, ent))
            self.checked.append(
                {"batch": self.last_credit_batch, "advantages": out["advantages"], "calls": list(PROMPT_CALLS),
                 "questions": [(x["prompt"][-1]["content"], x["answer"]) for x in inputs],
                 "oracle": torch.stack([r[0] for r in rows]), "entropy": torch.stack([r[1] for r in rows]),
                 "est": SEEN["est"][-1], "cal": SEEN["cal"][-1]}
            )
            return out

    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    trainer = Spy(model=model, reward_funcs=RewardLog(), args=_args(tmp_path), train_dataset=_dataset(),
                  processing_class=tok, credit=SPEC)
    trainer.checked = []
    passes = []
    forward = trainer._signal_forward
    trainer._signal_forward = lambda *a, **k: passes.append(a[0]) or forward(*a, **k)
    assert trainer._plan.passes == ("policy", "oracle")  # derived from the declarations alone
    trainer.train()

    assert len(trainer.checked) == 2
    assert len(passes) == 2 * 2  # per generation: the policy pass and the declared oracle pass
    for rec in trainer.checked:
        b, m = rec["batch"], rec["batch"].mask
        assert rec["calls"] == rec["questions"]  # the declared prompt, once per row, with the row's answer
        torch.testing.assert_close(b.oracle_logprobs[m], rec["oracle"][m], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(b.entropy[m], rec["entropy"][m], atol=2e-4, rtol=1e-4)
        _check_credit(b, rec["advantages"], rec["est"], rec["cal"])
