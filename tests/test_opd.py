"""OPD / OPPO oracle passes in the trainer: which model scores which prompt, and the teacher checks."""

from __future__ import annotations

import pytest
import torch

from tokencredit.train.config import (
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)
from tokencredit.engine.forward import forward_response
from tokencredit.credit.methods.opd import OPDConfig
from tokencredit.engine.signals import token_signals
from tokencredit.data.tasks import make_task
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.credit.methods.opd import oracle_prompt
from tokencredit.engine.passes import join_prompts_and_responses as _join
from tokencredit.train.collect import StepBatch
from tokencredit.train.trainer import Trainer


def _trainer(tmp_path, credit, args=(), teacher=False):
    cfg = TrainConfig(
        credit=credit, credit_args=tuple(args), steps=1, output_dir=str(tmp_path / "run"),
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=8, n_eval=2),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, temperature=1.0),
        optim=OptimConfig(lr=1e-3, micro_batch_size=4),
        log=LogConfig(eval_every=100, eval_samples=1, progress=False, eval_at_start=False, save_rollouts=False),
    )
    model, tok = tiny_model_and_tokenizer(seed=0)
    task = make_task("add1", seed=0, n_train=8, n_eval=2)
    t = tiny_model_and_tokenizer(seed=1)[0] if teacher else None
    return Trainer(cfg, model=model, tokenizer=tok, task=task, teacher=t)


def _scores(model, ids, att, P, resp):
    with torch.no_grad():
        _, logits = forward_response(model, ids, att, P)
    return token_signals(logits, resp, temperature=1.0, want=("logprobs",))["logprobs"]


def _signals(tr):
    """One rollout batch of the untrained policy and its signals, as train_step computes them."""
    batch = StepBatch.assemble(tr._collect()["parts"], tr.tokenizer.pad_token_id)
    return batch, tr._signals(batch, tr.plan)


def _oracle_prompt_inputs(tr, b):
    texts = [tr.tokenizer.apply_chat_template(
        [{"role": "user", "content": oracle_prompt(e.question, e.answer)}], tokenize=False, add_generation_prompt=True)
        for e in (b.examples[i] for i in b.prompt_index.tolist())]
    return _join(tr.tokenizer, texts, b.response_ids, b.response_mask)


def test_opd_teacher_scores_the_students_own_prompt(tmp_path):
    tr = _trainer(tmp_path, "opd", ["opd.oracle=teacher"], teacher=True)
    b, sig = _signals(tr)
    m = b.response_mask.bool()
    assert b.oracle_input_ids is None  # no oracle prompt was built
    own = _scores(tr.teacher, b.input_ids, b.attention_mask, b.prompt_len, b.response_ids)
    torch.testing.assert_close(sig["oracle_logprobs"][m], own[m])
    # and not the oracle prompt (what OPPO's teacher-oracle scores)
    x = _oracle_prompt_inputs(tr, b)
    plus = _scores(tr.teacher, x["input_ids"], x["attention_mask"], x["prompt_len"], b.response_ids)
    assert not torch.allclose(plus[m], own[m])


@pytest.mark.parametrize("credit,scorer", [("opd", "policy"), ("oppo", "policy"), ("oppo", "teacher")])
def test_self_distillation_and_oppo_score_the_oracle_prompt(tmp_path, credit, scorer):
    teacher = scorer == "teacher"
    tr = _trainer(tmp_path, credit, [f"{credit}.oracle=teacher"] if teacher else [], teacher=teacher)
    b, sig = _signals(tr)
    m = b.response_mask.bool()
    # the privileged context (the reference answer) is what makes self-distillation's signal non-zero
    x = _oracle_prompt_inputs(tr, b)
    torch.testing.assert_close(b.oracle_input_ids, x["input_ids"])
    model = tr.teacher if teacher else tr.model
    plus = _scores(model, x["input_ids"], x["attention_mask"], x["prompt_len"], b.response_ids)
    torch.testing.assert_close(sig["oracle_logprobs"][m], plus[m])
    assert not torch.allclose(sig["oracle_logprobs"][m], sig["logprobs"][m])


@pytest.mark.parametrize("credit,args", [("oppo", ["oppo.oracle=teacher"]), ("opd", ["opd.oracle=teacher"]),
                                         ("oppo+stare", ["oppo.oracle=teacher"])])
def test_teacher_oracle_without_a_teacher_is_an_error(tmp_path, credit, args):
    with pytest.raises(ValueError, match=r"model\.teacher.*oracle='teacher'.*got none"):
        _trainer(tmp_path, credit, args)


@pytest.mark.parametrize("credit", ["oppo", "opd"])
def test_self_oracle_with_a_teacher_is_an_error(tmp_path, credit):
    with pytest.raises(ValueError, match=r"model\.teacher.*oracle='self'.*got a teacher"):
        _trainer(tmp_path, credit, teacher=True)


def test_opd_config_oracle_fields():
    assert OPDConfig().oracle == "self"
    with pytest.raises(ValueError, match="opd oracle"):
        OPDConfig(oracle="gpt")
    with pytest.raises(ValueError, match="opd oracle_template"):
        OPDConfig(oracle_template="{prompt} only")


# ---- TRL -----------------------------------------------------------------------------


def _trl_trainer(tmp_path, credit_config, teacher):
    pytest.importorskip("trl")
    from test_trl import RewardLog, _args, _dataset

    from tokencredit.integrations.trl import TokenCreditGRPOTrainer

    class Capture(TokenCreditGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.captured = (out, inputs)
            return out

    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    extra = {"oracle_model": tiny_model_and_tokenizer(seed=1, eos_bias=2.0)[0]} if teacher else {}
    return Capture(model=model, reward_funcs=RewardLog(), args=_args(tmp_path, max_steps=1), train_dataset=_dataset(),
                   processing_class=tok, credit="opd", credit_config=credit_config, **extra)


def test_trl_opd_teacher_scores_the_students_own_prompt(tmp_path):
    from test_trl import _logits, _token_logprobs

    tr = _trl_trainer(tmp_path, {"opd": {"oracle": "teacher"}}, teacher=True)
    tr.train()
    out, _ = tr.captured
    comp, T = out["completion_ids"], out["completion_ids"].shape[1]
    ids = torch.cat([out["prompt_ids"], comp], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        own = _token_logprobs(_logits(tr.oracle_model, ids, att, T), comp)
    batch = tr.last_credit_batch
    m = batch.mask
    torch.testing.assert_close(batch.oracle_logprobs[m], own[m], atol=1e-5, rtol=1e-5)


def test_trl_teacher_oracle_without_a_teacher_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"oracle_model: credit 'opd' has opd.oracle='teacher'.*got none"):
        _trl_trainer(tmp_path, {"opd": {"oracle": "teacher"}}, teacher=False)
