"""The plan (which passes a credit spec needs) and the one module that runs them."""

from __future__ import annotations

import pytest
import torch

from tokencredit.engine.forward import forward_response
from tokencredit.engine.models import ValueHead, adapter_disabled, add_lora
from tokencredit.engine.passes import PassInputs, PassModels, oracle_texts, run_passes
from tokencredit.credit.plan import PlanError, plan_signals
from tokencredit.engine.signals import hidden_residual, token_signals
from tokencredit.credit.spec import CreditPipeline
from tokencredit.testing import tiny_model_and_tokenizer


@pytest.mark.parametrize(
    "spec,kw,passes",
    [
        ("grpo", {}, ()),
        ("taco", {}, ("policy",)),
        ("grpo+taco+acpo", {}, ("policy",)),  # three calibrators, one policy pass
        ("arca", {"lora": True}, ("policy", "adapter_off")),
        # the LoRA reference and ARCA's residual share one adapter-off pass
        ("divergence", {"lora": True}, ("policy", "adapter_off")),
        ("divergence", {"lora": False}, ("policy", "reference")),
        ("divergence", {"lora": True, "explicit_reference": True}, ("policy", "reference")),
        ("oppo+stare", {}, ("policy", "oracle")),
        ("pact", {}, ("policy", "critic")),
        ("gae", {}, ("policy", "critic")),
        ("grpo", {"kl": True}, ("policy", "reference")),
    ],
)
def test_a_spec_gets_the_minimal_passes(spec, kw, passes):
    kw.setdefault("lora", False)
    assert plan_signals(CreditPipeline(spec), **kw).passes == passes


def test_arca_on_one_pass_with_the_lora_reference():
    p = plan_signals(CreditPipeline("divergence"), lora=True, kl=False)
    assert p.adapter_off == ("logprobs",)
    p = plan_signals(CreditPipeline("arca"), lora=True, kl=True)
    assert p.adapter_off == ("logprobs", "hidden") and not p.reference


def test_declared_needs_that_cannot_be_met_are_one_line_errors():
    with pytest.raises(PlanError, match=r"arca reads the LoRA adapter.*--model.lora"):
        plan_signals(CreditPipeline("rloo+arca"), lora=False)
    with pytest.raises(PlanError, match=r"teacher.*got none"):
        plan_signals(CreditPipeline("oppo", oppo={"oracle": "teacher"}), lora=False)
    with pytest.raises(PlanError, match=r"teacher.*got none"):
        plan_signals(CreditPipeline("opd", opd={"oracle": "teacher"}), lora=False)
    # with a teacher: OPPO's teacher sees the oracle prompt, OPD's the student's own prompt
    assert plan_signals(CreditPipeline("oppo", oppo={"oracle": "teacher"}), lora=False, teacher=True).oracle.prompt is not None
    opd = plan_signals(CreditPipeline("opd", opd={"oracle": "teacher"}), lora=False, teacher=True).oracle
    assert opd.prompt is None and opd.scorer == "teacher"


def test_signals_that_depend_on_the_config_are_declared_per_config():
    """TACO's ar_lopti mode reads the rollout probability (old_logprobs): the declaration is a
    function of the config, bound by the pipeline, so the plan, replays and the verl/TRL checks
    see it; the other modes do not demand it."""
    from dataclasses import dataclass

    from tokencredit.credit import registry
    from tokencredit.credit.registry import get_method

    assert get_method("taco").requires == {"logprobs", "entropy"}  # the default config's
    assert CreditPipeline("grpo+taco").required_signals == {"logprobs", "entropy"}
    ar = CreditPipeline("grpo+taco", taco={"mode": "ar_lopti"})
    assert ar.required_signals == {"logprobs", "entropy", "old_logprobs"}
    assert ar.calibrators[0].requires == {"logprobs", "entropy", "old_logprobs"}
    assert "old_logprobs" in plan_signals(ar, lora=False).signals

    @dataclass
    class Cfg:
        more: bool = False

    saved = dict(registry._REGISTRY)
    try:
        with pytest.raises(ValueError, match=r"requires unknown signal\(s\) \['nope'\]"):
            registry.register_calibrator("toy_bad_requires", config=Cfg, requires=lambda c: ("nope",),
                                         provenance="paper", summary="-")(lambda b, a, c, s=None: None)
        registry.register_calibrator("toy_mode_requires", config=Cfg, requires=lambda c: ("entropy",) + (("nope",) if c.more else ()),
                                     provenance="paper", summary="-")(lambda b, a, c, s=None: None)
        assert CreditPipeline("grpo+toy_mode_requires").required_signals == {"entropy"}
        with pytest.raises(ValueError, match=r"toy_mode_requires: requires unknown signal"):
            CreditPipeline("grpo+toy_mode_requires", toy_mode_requires={"more": True})
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


def test_critic_declarations():
    pact = plan_signals(CreditPipeline("pact"), lora=False).critic
    gae = plan_signals(CreditPipeline("gae"), lora=False).critic
    assert (pact.transform, pact.after_actor) == ("sigmoid", True)
    assert (gae.transform, gae.after_actor) == ("identity", False)
    # PACT's IS range is PACT's own config
    w = plan_signals(CreditPipeline("pact", pact={"is_low": 0.9, "is_high": 1.1}), lora=False).critic.is_weights(
        torch.log(torch.tensor([[0.5, 0.52, 0.7]])), torch.log(torch.tensor([[0.5, 0.5, 0.5]])), torch.ones(1, 3)
    )
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.04, 0.0]]))


def _inputs(tok, n=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = ["12+3=", "7+7=", "12+3=", "7+7="][:n]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    resp = torch.randint(3, 20, (n, T), generator=g)
    rmask = torch.ones(n, T, dtype=torch.long)
    rmask[1, 3:] = 0
    return PassInputs(
        input_ids=torch.cat([enc["input_ids"], resp], 1),
        attention_mask=torch.cat([enc["attention_mask"], rmask], 1),
        prompt_len=enc["input_ids"].shape[1], response_ids=resp, response_mask=rmask,
        oracle_input_ids=torch.cat([enc["input_ids"], resp], 1).flip(0),
        oracle_attention_mask=torch.cat([enc["attention_mask"], rmask], 1).flip(0),
        oracle_prompt_len=enc["input_ids"].shape[1],
    )


def test_run_passes_equals_independent_forwards_and_runs_each_pass_once():
    model, tok = tiny_model_and_tokenizer(seed=0)
    model = add_lora(model, r=4, alpha=8)
    with torch.no_grad():  # a non-zero adapter, so that adapter on and off differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    teacher, _ = tiny_model_and_tokenizer(seed=3)
    inp = _inputs(tok)
    credit = CreditPipeline("oppo+arca", oppo={"oracle": "teacher"})
    plan = plan_signals(credit, lora=True, kl=True, teacher=True).with_signals({"entropy", "mode_prob"})
    calls = []

    def counting_forward(m, ids, att, P, *, hidden=False):
        calls.append(m)
        return forward_response(m, ids, att, P, hidden=hidden)

    got = run_passes(plan, PassModels(policy=model, teacher=teacher), inp, temperature=1.0, micro_batch_size=8,
                     forward=counting_forward)
    # policy, adapter-off (reference and residual), teacher on the oracle input: three passes
    assert len(calls) == 3
    assert model.training  # restored
    m = inp.response_mask.bool()
    with torch.no_grad():
        model.eval()
        h, logits = forward_response(model, inp.input_ids, inp.attention_mask, inp.prompt_len, hidden=True)
        want = token_signals(logits, inp.response_ids, temperature=1.0, want=("logprobs", "entropy", "mode_prob"))
        with adapter_disabled(model):
            hb, lb = forward_response(model, inp.input_ids, inp.attention_mask, inp.prompt_len, hidden=True)
        _, lt = forward_response(teacher, inp.oracle_input_ids, inp.oracle_attention_mask, inp.prompt_len)
        model.train()
    for k in ("logprobs", "entropy", "mode_prob"):
        torch.testing.assert_close(got[k][m], want[k][m])
    torch.testing.assert_close(got["ref_logprobs"][m], token_signals(lb, inp.response_ids, want=("logprobs",))["logprobs"][m])
    torch.testing.assert_close(got["hidden_residual"][m], hidden_residual(h[:, :-1], hb[:, :-1])[m])
    torch.testing.assert_close(got["oracle_logprobs"][m], token_signals(lt, inp.response_ids, want=("logprobs",))["logprobs"][m])
    assert not torch.allclose(got["ref_logprobs"][m], got["logprobs"][m])  # the adapter matters


def test_given_signals_are_not_recomputed_and_the_critic_transform_applies():
    model, tok = tiny_model_and_tokenizer(seed=0)
    inp = _inputs(tok)
    head = ValueHead(model.config.hidden_size)
    plan = plan_signals(CreditPipeline("pact"), lora=False)
    calls = []

    def counting_forward(m, ids, att, P, *, hidden=False):
        calls.append(hidden)
        return forward_response(m, ids, att, P, hidden=hidden)

    got = run_passes(plan, PassModels(policy=model, critic=head), inp, temperature=1.0, micro_batch_size=2, forward=counting_forward)
    assert calls == [True, True]  # two micro-batches of the one policy pass, with hidden states
    assert ((got["values"] > 0) & (got["values"] < 1)).all()  # PACT: sigmoid of the head
    torch.testing.assert_close(got["values"], torch.sigmoid(head(got["hidden"]).squeeze(-1)))
    lp = torch.zeros_like(inp.response_ids, dtype=torch.float32)
    calls.clear()
    got = run_passes(plan_signals(CreditPipeline("surprisal"), lora=False), PassModels(policy=model), inp,
                     temperature=1.0, micro_batch_size=8, forward=counting_forward, given={"logprobs": lp})
    assert calls == [] and got["logprobs"] is lp


def test_oracle_texts_follow_the_declaration():
    plan = plan_signals(CreditPipeline("oppo"), lora=False)
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "3*4?"}]
    out = oracle_texts(plan, [conv, "raw prompt"], ["3*4?", "2*2?"], ["12", 4], render=lambda c: "|".join(m["content"] for m in c))
    assert out[0].startswith("s|3*4?") and "12" in out[0] and "4" in out[1] and out[1] != "raw prompt"
    plan = plan_signals(CreditPipeline("opd", opd={"oracle": "teacher"}), lora=False, teacher=True)
    out = oracle_texts(plan, [conv], ["3*4?"], ["12"], render=lambda c: "|".join(m["content"] for m in c))
    assert out == ["s|3*4?"]  # the student's own prompt


def _oracle_methods():
    """The registered methods that read oracle_logprobs and declare a policy-scored pass at their defaults."""
    from tokencredit.credit.registry import get_method, list_methods

    infos = [get_method(n) for n in list_methods("estimator")]
    return [i for i in infos if "oracle_logprobs" in i.requires and i.oracle(i.config_cls()).scorer == "policy"]


def test_the_default_oracle_is_what_the_oracle_methods_declare():
    """A saved eval batch's oracle log-probs (a spec without an oracle method) come from the
    pass every registered oracle method declares at its defaults, so inspect can replay each."""
    plan = plan_signals(CreditPipeline("grpo"), lora=False).with_signals({"oracle_logprobs"})
    assert plan.passes == ("policy", "oracle") and plan.oracle.scorer == "policy"
    methods = _oracle_methods()
    assert len(methods) >= 2
    for info in methods:
        assert info.oracle(info.config_cls()).prompt("What is 3*4?", "12") == plan.oracle.prompt("What is 3*4?", "12"), info.name


def test_a_registered_methods_oracle_declaration_is_the_default(monkeypatch):
    """plan.py names no method: with the registry's oracle methods replaced by one registered
    here, the default oracle pass is the one it declares; with none, a one-line PlanError."""
    from dataclasses import dataclass

    from tokencredit.credit import registry
    from tokencredit.credit.registry import OraclePass, register_estimator

    monkeypatch.setattr(registry, "_REGISTRY", {n: i for n, i in registry._REGISTRY.items() if i not in _oracle_methods()})
    with pytest.raises(PlanError, match="^oracle_logprobs: expected a registered method"):
        plan_signals(CreditPipeline("grpo"), lora=False).with_signals({"oracle_logprobs"})

    @dataclass
    class HintConfig:
        hint: str = "think of {answer}"

    register_estimator(
        "test_hint_oracle", config=HintConfig, requires=("oracle_logprobs",), provenance="reconstructed",
        summary="test", oracle=lambda c: OraclePass(prompt=lambda q, a: f"{q} ({c.hint.format(answer=a)})", scorer="policy"),
    )(lambda batch, config: None)
    plan = plan_signals(CreditPipeline("grpo"), lora=False).with_signals({"oracle_logprobs"})
    assert plan.oracle.prompt("3*4?", "12") == "3*4? (think of 12)"
