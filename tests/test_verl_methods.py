"""Every seed method through the verl plugin: the advantages verl's loss receives equal the core
``CreditPipeline``'s on the same batch (driver-side estimators GTPO, OPPO, OPD, GAE, PACT through
verl's ``compute_advantage``; adaptive STARE through the driver's controller step and the engine
loss), the oracle inputs built with a real tokenizer score like the core's oracle pass, the
critic loss and IS step, the trainer mode's config checks, and ``examples/verl/smoke.sh``'s dry
run against verl's own config loader. CPU only, no Ray."""

from __future__ import annotations

import os
import shlex
import subprocess
from functools import partial

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")

import numpy as np  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

from tokencredit import CreditBatch, CreditInputError, CreditPipeline  # noqa: E402
from tokencredit.integrations import verl as tcv  # noqa: E402
from tokencredit.integrations.verl import trainer as tct  # noqa: E402
from tokencredit.integrations.verl.oracle import oracle_prompt_ids, oracle_samples  # noqa: E402
from tokencredit.credit.methods.pact import pact_critic_is_weights, pact_critic_loss  # noqa: E402
from tokencredit.credit.plan import plan_signals  # noqa: E402

from test_verl import TRAINER_OVERRIDES, _engine_micro_batch, actor_config, by_hand_ppo, compose_verl, policy_tensors, rollout  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_settings(monkeypatch):
    monkeypatch.delenv(tcv.ENV_VAR, raising=False)
    tcv.install_settings(None)
    yield
    tcv.install_settings(None)


def step_signals(mask, seed=5):
    """The driver's signals of one step batch ([B, T], zero on padding as verl pads them)."""
    gen = torch.Generator().manual_seed(seed)
    logp, _ = policy_tensors(mask, seed=seed)
    return {
        "entropy": torch.rand(mask.shape, generator=gen) * 2.0 * mask,
        "logprobs": logp,
        "oracle_logprobs": (logp + torch.randn(mask.shape, generator=gen) * 0.7).clamp_max(0) * mask,
        "values": torch.randn(mask.shape, generator=gen) * mask,  # the critic head's raw output
        # the responses' token ids, from a small vocabulary so that groups share tokens (KTAE)
        "token_ids": torch.randint(0, 6, mask.shape, generator=gen) * mask.long(),
    }


# -- (1) driver-side estimators: verl's compute_advantage == the core ----------------------------


@pytest.mark.parametrize("name", ["gtpo", "oppo", "opd", "gae", "pact", "ktae"])
def test_driver_estimator_equals_core(name):
    tlr, mask, uid, rewards = rollout()
    pipe = CreditPipeline(name)
    plan = plan_signals(pipe, lora=False)
    raw = step_signals(mask)
    need = pipe.estimator.requires
    assert need, name
    signals = {k: v for k, v in raw.items() if k in need}
    if "values" in need:
        signals["values"] = tct.critic_values(plan, raw["values"])  # the declared transform (PACT: sigmoid)
    tcv.install_settings(tcv.settings_from_dict({"spec": name}))
    data = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid})
    with tcv.driver_signals(mask, signals):
        out = compute_advantage(data, adv_estimator=f"tc_{name}", config=AlgoConfig())

    _, gids = np.unique(uid.astype(str), return_inverse=True)
    core_signals = dict(signals)
    if "values" in core_signals:
        core_signals["values"] = torch.cat([signals["values"], torch.zeros(len(mask), 1)], dim=1)
    core = CreditPipeline(name)(CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids), **core_signals))
    assert core.advantages.abs().sum() > 0
    torch.testing.assert_close(out.batch["advantages"], core.advantages, rtol=0, atol=0)
    expected_returns = core.returns if core.returns is not None else core.advantages
    torch.testing.assert_close(out.batch["returns"], expected_returns, rtol=0, atol=0)

    # outside the trainer mode the estimator says where its signals come from
    data = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid})
    with pytest.raises(CreditInputError, match="trainer_mode=tokencredit_sync"):
        compute_advantage(data, adv_estimator=f"tc_{name}", config=AlgoConfig())
    # a mask that is not the driver's (rows reordered) is refused, not silently misaligned
    data = DataProto.from_dict(tensors={"token_level_rewards": tlr.flip(0), "response_mask": mask.flip(0)}, non_tensors={"uid": uid})
    with tcv.driver_signals(mask, signals), pytest.raises(CreditInputError, match="response_mask"):
        compute_advantage(data, adv_estimator=f"tc_{name}", config=AlgoConfig())


# -- (2) adaptive STARE: the controller steps on the driver, the loss reads the stepped state ---


def test_the_driver_steps_the_controller_on_every_row_of_the_step():
    """step_credit_state reads the whole batch: rows whose mean entropy lies on the other side of
    H_target from the batch's would step STARE the other way (the verl e2e run cannot tell: its
    H_target sits above every batch's mean entropy)."""
    mask = torch.ones(4, 6)
    entropy = torch.tensor([0.2] * 2 + [2.0] * 2).unsqueeze(1).expand(4, 6).clone()  # mean 1.1; first half 0.2
    cfg = {"adaptive": True, "H_target": 1.0, "a": 0.05, "W": 1.1, "M": 0.9}
    driver = CreditPipeline("grpo+stare", stare=cfg)
    tct.step_credit_state(driver, mask, {"entropy": entropy})
    whole, half = CreditPipeline("grpo+stare", stare=cfg), CreditPipeline("grpo+stare", stare=cfg)
    whole.update_state(CreditBatch(response_mask=mask.bool(), rewards=torch.zeros(4), group_ids=torch.arange(4), entropy=entropy))
    half.update_state(CreditBatch(response_mask=mask[:2].bool(), rewards=torch.zeros(2), group_ids=torch.arange(2), entropy=entropy[:2]))
    assert driver.state_dict() == whole.state_dict() != half.state_dict(), (driver.state_dict(), half.state_dict())


def test_adaptive_stare_steps_on_driver_and_the_loss_equals_core():
    tlr, mask, uid, rewards = rollout()
    cfg = {"adaptive": True, "H_target": 0.9, "a": 0.05, "P": 0.3}
    settings = tcv.settings_from_dict({"spec": "grpo+stare", "stare": cfg})
    _, gids = np.unique(uid.astype(str), return_inverse=True)
    driver = CreditPipeline("grpo+stare", stare=cfg)  # the trainer's copy (the state lives here)
    core = CreditPipeline("grpo+stare", stare=cfg)
    logp, old = policy_tensors(mask)
    states = []
    for step, scale in enumerate((0.1, 0.2)):  # low entropy: W grows, M shrinks, step after step
        entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(step)) * scale * mask
        metrics = tct.step_credit_state(driver, mask, {"entropy": entropy, "logprobs": old})
        state = driver.state_dict()
        states.append(state["stare"])
        data = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid})
        adv = compute_advantage(data, adv_estimator="tc_grpo", config=AlgoConfig()).batch["advantages"]
        model_output, mb = _engine_micro_batch(logp, old, adv, mask, entropy)
        loss_fn = partial(tcv.tokencredit_ppo_loss, config=actor_config(calculate_entropy=True), settings=settings, credit_state=state)
        loss, loss_metrics = loss_fn(model_output=model_output, data=mb, dp_group=None)

        batch = CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids), logprobs=logp, entropy=entropy)
        ref = core(batch)  # the core: controller step from this batch, then the credit with the new state
        assert metrics["stare/W_next"] == ref.metrics["stare/W_next"]
        torch.testing.assert_close(loss, by_hand_ppo(logp, old, ref.advantages, mask), rtol=1e-6, atol=1e-7)
    assert states[1]["W"] > states[0]["W"] > 1.0 and states[1]["step"] == 2

    # the loss alone (no driver step shipped) refuses a stateful spec
    model_output, mb = _engine_micro_batch(logp, old, adv, mask, entropy)
    with pytest.raises(ValueError, match="stepped once per step on the driver"):
        tcv.tokencredit_ppo_loss(actor_config(calculate_entropy=True), model_output, mb, settings=settings)


def test_the_driver_steps_a_controller_with_the_step_rewards():
    """A controller that reads outcomes (SEPA's correctness gate) gets each row's summed
    token_level_rewards on the driver, not the zeros that only complete a calibrator's batch."""
    mask = torch.ones(4, 3)
    stepped = CreditPipeline("grpo+sepa", sepa={"correct_rate_gate": 0.5})
    tct.step_credit_state(stepped, mask, {}, rewards=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert stepped.state_dict()["sepa"]["gate_open"] is True
    unrewarded = CreditPipeline("grpo+sepa", sepa={"correct_rate_gate": 0.5})
    tct.step_credit_state(unrewarded, mask, {})
    assert unrewarded.state_dict()["sepa"]["gate_open"] is False


def test_credit_state_checkpoint_round_trip(tmp_path):
    a = CreditPipeline("grpo+stare", stare={"adaptive": True})
    batch_mask = torch.ones(2, 3)
    tct.step_credit_state(a, batch_mask, {"entropy": torch.zeros(2, 3)})
    tct.save_credit_state(str(tmp_path / "global_step_1"), a)
    b = CreditPipeline("grpo+stare", stare={"adaptive": True})
    assert tct.load_credit_state(str(tmp_path / "global_step_1"), b)
    assert b.state_dict() == a.state_dict() != CreditPipeline("grpo+stare", stare={"adaptive": True}).state_dict()
    with pytest.raises(ValueError, match="spec 'grpo\\+stare', expected 'rloo\\+stare'"):
        tct.load_credit_state(str(tmp_path / "global_step_1"), CreditPipeline("rloo+stare"))
    assert not tct.load_credit_state(str(tmp_path / "nothing"), b)


# -- (3) the oracle inputs, with a real tokenizer and model ----------------------------------


def test_oracle_inputs_score_like_the_core_oracle_pass():
    from tokencredit.engine.passes import (
        PassInputs,
        PassModels,
        join_prompts_and_responses,
        oracle_texts,
        run_passes,
    )
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0)
    model.eval()
    raw = [
        [{"role": "user", "content": "What is 2+3?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    ]
    rms = [{"style": "rule", "ground_truth": "5"}, {"style": "rule", "ground_truth": "red"}]
    plan = plan_signals(CreditPipeline("oppo"), lora=False)
    ids = oracle_prompt_ids(plan, tok, raw, rms)
    text0 = tok.decode(ids[0])
    assert "5" in text0 and "What is 2+3?" in text0 and "Be brief." in tok.decode(ids[1])

    gen = torch.Generator().manual_seed(0)
    lens = [5, 3]
    responses = [torch.randint(3, 40, (n,), generator=gen) for n in lens]
    masks = [torch.ones(n, dtype=torch.int64) for n in lens]
    samples = oracle_samples(ids, responses, masks)
    # what verl's engine gives for each sample: position i's output scores token i + 1
    verl_lp = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=s["input_ids"][None], position_ids=s["position_ids"][None]).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            P, R = len(s["prompts"]), len(s["responses"])
            verl_lp.append(lp[P - 1 : P + R - 1].gather(-1, s["responses"][:, None]).squeeze(-1))

    # the core's oracle pass on the same rows (left-padded prompts, right-padded responses)
    T = max(lens)
    resp = torch.zeros(2, T, dtype=torch.long)
    rmask = torch.zeros(2, T, dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, : len(r)] = r
        rmask[i, : len(r)] = 1
    render = lambda c: tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)  # noqa: E731
    questions = [c[-1]["content"] for c in raw]
    texts = oracle_texts(plan, raw, questions, [r["ground_truth"] for r in rms], render)
    own = join_prompts_and_responses(tok, [render(c) for c in raw], resp, rmask)
    orc = join_prompts_and_responses(tok, texts, resp, rmask, prefix="oracle_")
    inp = PassInputs(input_ids=own["input_ids"], attention_mask=own["attention_mask"], prompt_len=own["prompt_len"],
                     response_ids=resp, response_mask=rmask, **orc)
    core = run_passes(plan, PassModels(policy=model), inp, temperature=1.0, micro_batch_size=2)["oracle_logprobs"]
    for i, n in enumerate(lens):
        torch.testing.assert_close(verl_lp[i], core[i, :n].float(), rtol=1e-4, atol=1e-5)

    with pytest.raises(ValueError, match="ground_truth"):
        oracle_prompt_ids(plan, tok, raw, [{"style": "rule"}, rms[1]])


class VerlLikeTeacher:
    """A stand-in for verl's ``AsyncTeacherLLMServerManager`` backed by a real (tiny) model: the
    output layout of verl's vLLM teacher (``extract_prompt_logprobs`` with ``prompt_logprobs=0``):
    row i holds the log-prob of token i + 1 and its id, a dummy 0 row last."""

    def __init__(self, model, shift=1):
        self.model, self.shift, self.calls = model, shift, 0

    async def compute_teacher_logprobs_single(self, sequence_ids, **_):
        self.calls += 1
        ids = torch.tensor(sequence_ids)[None]
        with torch.no_grad():
            lp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), -1)
        nxt = ids[0, self.shift:]
        rows = lp[: len(nxt)].gather(-1, nxt[:, None])
        pad = len(sequence_ids) - len(nxt)
        return (torch.cat([nxt[:, None], torch.zeros(pad, 1, dtype=torch.long)]).int(),
                torch.cat([rows, torch.zeros(pad, 1)]))


@pytest.mark.parametrize("method", ["oppo", "opd"])
def test_teacher_oracle_through_verls_teacher_output_equals_the_core_teacher_pass(method):
    """OPPO's teacher-oracle (the oracle prompt) and OPD with a teacher (the student's own prompt),
    scored in the layout verl's distillation teacher returns, equal the core's teacher pass."""
    from tokencredit.integrations.verl.oracle import response_logprobs, teacher_response_logprobs
    from tokencredit.engine.passes import (
        PassInputs,
        PassModels,
        join_prompts_and_responses,
        oracle_texts,
        run_passes,
    )
    from tokencredit.testing import tiny_model_and_tokenizer

    policy, tok = tiny_model_and_tokenizer(seed=0)
    teacher, _ = tiny_model_and_tokenizer(seed=1)
    policy.eval(), teacher.eval()
    raw = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Name a colour."}]]
    rms = [{"ground_truth": "5"}, {"ground_truth": "red"}]
    pipe = CreditPipeline(method, {method: {"oracle": "teacher"}})
    plan = plan_signals(pipe, lora=False, teacher=True)
    assert plan.oracle.scorer == "teacher" and (plan.oracle.prompt is None) == (method == "opd")
    render = lambda c: tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)  # noqa: E731
    own_ids = [tok(render(c), add_special_tokens=False)["input_ids"] for c in raw]
    gen = torch.Generator().manual_seed(0)
    lens = [5, 3]
    responses = [torch.randint(3, 40, (n,), generator=gen) for n in lens]
    fake = VerlLikeTeacher(teacher)
    if method == "oppo":  # the trainer mode sends the oracle prompts to the teacher servers
        got = teacher_response_logprobs(fake, oracle_prompt_ids(plan, tok, raw, rms), responses)
        assert fake.calls == 2
    else:  # verl's agent loop scored prompt + response; the trainer mode reads its output
        import asyncio

        outs = [asyncio.run(fake.compute_teacher_logprobs_single(p + r.tolist())) for p, r in zip(own_ids, responses)]
        got = [response_logprobs(i, lp, len(p), r) for (i, lp), p, r in zip(outs, own_ids, responses)]

    T = max(lens)
    resp = torch.zeros(2, T, dtype=torch.long)
    rmask = torch.zeros(2, T, dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, : len(r)], rmask[i, : len(r)] = r, 1
    texts = oracle_texts(plan, raw, [c[-1]["content"] for c in raw], [r["ground_truth"] for r in rms], render)
    own = join_prompts_and_responses(tok, [render(c) for c in raw], resp, rmask)
    orc = join_prompts_and_responses(tok, texts, resp, rmask, prefix="oracle_")
    inp = PassInputs(input_ids=own["input_ids"], attention_mask=own["attention_mask"], prompt_len=own["prompt_len"],
                     response_ids=resp, response_mask=rmask, **orc)
    core = run_passes(plan, PassModels(policy=policy, teacher=teacher), inp, temperature=1.0, micro_batch_size=2)["oracle_logprobs"]
    self_core = run_passes(plan_signals(CreditPipeline(method), lora=False), PassModels(policy=policy), inp,
                           temperature=1.0, micro_batch_size=2)["oracle_logprobs"]
    for i, n in enumerate(lens):
        torch.testing.assert_close(got[i], core[i, :n].float(), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got[i], self_core[i, :n].float(), atol=1e-3)  # the teacher, not the policy, scored
    laid = tct._rows_to_width(got, [0, 2], 3, T + 1)
    assert laid.shape == (3, T + 1) and torch.equal(laid[1], torch.zeros(T + 1)) and torch.equal(laid[2, :3], got[1])


class FakeTransferQueue:
    """What the trainer mode reads from TransferQueue (``kv_batch_get``): jagged tensors for
    tensor fields, lists for the rest; one partition."""

    def __init__(self, rows):
        self.rows = rows  # key -> {field: value}

    def kv_batch_get(self, keys, partition_id, select_fields):
        out = {}
        for f in select_fields:
            vals = [self.rows[k][f] for k in keys]
            out[f] = torch.nested.nested_tensor(vals, layout=torch.jagged) if torch.is_tensor(vals[0]) else vals
        return out


class PaddedTransferQueue:
    """``kv_batch_get`` as the trainer mode's advantage step reads it: a result whose
    ``to_padded_tensor()`` gives right-padded [B, T] tensors (jagged rows of one partition)."""

    def __init__(self, rows):
        self.rows = rows  # key -> {field: 1-D tensor}

    def kv_batch_get(self, keys, partition_id, select_fields):
        rows = self.rows

        class Result:
            def to_padded_tensor(self):
                return {f: torch.nested.nested_tensor([rows[k][f] for k in keys], layout=torch.jagged).to_padded_tensor(0)
                        for f in select_fields}

        return Result()


def test_trainer_mode_gives_ktae_the_responses_token_ids(monkeypatch):
    """The trainer mode's advantage step reads the step batch's ``responses`` into the driver
    signal ``token_ids`` (integers, laid out like ``response_mask``), and verl's advantage step
    with ``tc_ktae`` then equals the core pipeline on those tokens."""
    import sys
    import types

    tlr, mask, uid, rewards = rollout()
    tokens = step_signals(mask)["token_ids"]
    lens = mask.sum(1).long().tolist()
    rows = {f"k{i}": {"responses": tokens[i, :n], "response_mask": torch.ones(n, dtype=torch.int64)} for i, n in enumerate(lens)}
    monkeypatch.setitem(sys.modules, "transfer_queue", PaddedTransferQueue(rows))
    cfg = compose_verl(_with("tc_ktae", "+tokencredit.spec=ktae"))
    tr = object.__new__(tct.TokenCreditPPOTrainerSync)
    tr.config = cfg
    tr.tokencredit_credit, tr.tokencredit_plan = tct.trainer_plan(cfg, tct.check_trainer_config(cfg))
    tcv.install_settings(tcv.settings_from_dict({"spec": "ktae"}))

    def estimate(batch, metrics):  # verl's advantage step, inside the driver signals the trainer mode opened
        seen = dict(tcv.core._DRIVER.signals)
        data = DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uid})
        return seen, compute_advantage(data, adv_estimator="tc_ktae", config=AlgoConfig())

    monkeypatch.setattr(tr, "_tc_estimate", estimate)
    seen, out = tr._compute_advantage(types.SimpleNamespace(keys=list(rows), partition_id="train"), {})
    assert set(seen) == {"token_ids"} and not seen["token_ids"].is_floating_point()
    assert torch.equal(seen["token_ids"], tokens)
    _, gids = np.unique(uid.astype(str), return_inverse=True)
    core = CreditPipeline("ktae")(CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids), token_ids=tokens))
    grpo = CreditPipeline("grpo")(CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.as_tensor(gids)))
    assert not torch.allclose(core.advantages, grpo.advantages)  # the tokens matter
    torch.testing.assert_close(out.batch["advantages"], core.advantages, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["oppo", "opd"])
def test_trainer_mode_teacher_oracle_pass_on_a_batch_with_a_padding_sample(method, monkeypatch):
    """``_tc_oracle_pass`` with a teacher: the rows verl's TransferQueue holds (one of them a
    synthetic padding sample), the teacher scores the real rows, laid out [B, width]."""
    import asyncio
    import sys
    import types

    from tokencredit.testing import tiny_model_and_tokenizer

    _, tok = tiny_model_and_tokenizer(seed=0)
    teacher, _ = tiny_model_and_tokenizer(seed=1)
    teacher.eval()
    fake = VerlLikeTeacher(teacher)
    raw = [[{"role": "user", "content": "What is 2+3?"}], None, [{"role": "user", "content": "Name a colour."}]]
    answers = ["5", None, "red"]
    gen = torch.Generator().manual_seed(3)
    rows = {}
    for i, (conv, ans, n) in enumerate(zip(raw, answers, [4, 2, 6])):
        prompt = tok(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"] if conv else [1, 2]
        resp = torch.randint(3, 40, (n,), generator=gen)
        row = {"prompts": torch.tensor(prompt), "responses": resp, "response_mask": torch.ones(n, dtype=torch.int64),
               "raw_prompt": conv, "reward_model": {"ground_truth": ans}}
        if conv is not None:  # verl's agent loop scored prompt + response with the teacher (distillation.enabled)
            ids, lp = asyncio.run(fake.compute_teacher_logprobs_single(prompt + resp.tolist()))
            row.update(teacher_ids=ids, teacher_logprobs=lp)
        else:  # verl's padding sample: eos ids, zero log-probs (padding_utils)
            row.update(teacher_ids=torch.zeros(2 + n, 1, dtype=torch.int32), teacher_logprobs=torch.zeros(2 + n, 1))
        rows[f"k{i}"] = row
    monkeypatch.setitem(sys.modules, "transfer_queue", FakeTransferQueue(rows))
    fake.calls = 0

    cfg = compose_verl(_with(f"tc_{method}", f"+tokencredit.spec={method}", f"+tokencredit.{method}.oracle=teacher", *TEACHER))
    tr = object.__new__(tct.TokenCreditPPOTrainerSync)
    tr.config, tr.tokenizer, tr._tc_teacher = cfg, tok, fake
    tr.tokencredit_credit, tr.tokencredit_plan = tct.trainer_plan(cfg, tct.check_trainer_config(cfg))
    batch = types.SimpleNamespace(keys=["k0", "k1", "k2"], partition_id="train", extra_info={},
                                  tags=[{}, {"is_padding": True}, {}])
    lp = tr._tc_oracle_pass(batch, 7)
    assert lp.shape == (3, 7) and torch.equal(lp[1], torch.zeros(7)) and torch.equal(lp[0, 4:], torch.zeros(3))
    plan = tr.tokencredit_plan
    for i in (0, 2):
        r = rows[f"k{i}"]
        if method == "oppo":
            prompt = oracle_prompt_ids(plan, tok, [raw[i]], [r["reward_model"]])[0]
            assert "5" in tok.decode(prompt) if i == 0 else "red" in tok.decode(prompt)
        else:
            prompt = r["prompts"].tolist()
        ids = torch.tensor(prompt + r["responses"].tolist())[None]
        with torch.no_grad():
            want = torch.log_softmax(teacher(input_ids=ids).logits[0].float(), -1)
        P, n = len(prompt), len(r["responses"])
        want = want[P - 1 : P + n - 1].gather(-1, r["responses"][:, None]).squeeze(-1)
        torch.testing.assert_close(lp[i, :n], want, rtol=1e-4, atol=1e-5)
    # OPPO asks the teacher servers for the two real rows; OPD reads what verl's agent loop computed
    assert fake.calls == (2 if method == "oppo" else 0)


def test_teacher_must_have_the_actors_tokenizer_and_one_teacher_entry():
    import copy

    from tokencredit.testing import tiny_model_and_tokenizer

    _, tok = tiny_model_and_tokenizer(seed=0)
    tct.check_same_tokenizer(tok, copy.deepcopy(tok), "same")
    other = copy.deepcopy(tok)
    other.add_tokens(["<teacher-only>"])
    with pytest.raises(ValueError, match=r"expected a teacher with the actor's tokenizer .* got other-teacher with"):
        tct.check_same_tokenizer(tok, other, "other-teacher")
    # verl drops its default entry when another is added: one teacher in effect
    cfg = compose_verl(_with("tc_oppo", "+tokencredit.spec=oppo", "+tokencredit.oppo.oracle=teacher", *TEACHER,
                             "+distillation.teacher_models.t1.model_path=Org/T1", "+distillation.teacher_models.t1.key=gsm8k"))
    tct.check_trainer_config(cfg)
    assert tct.teacher_model_path(cfg) == "Org/T1"
    cfg = compose_verl(_with("tc_oppo", "+tokencredit.spec=oppo", "+tokencredit.oppo.oracle=teacher", *TEACHER,
                             "+distillation.teacher_models.t1.model_path=Org/T1", "+distillation.teacher_models.t2.model_path=Org/T2"))
    with pytest.raises(ValueError, match=r"one teacher; expected one entry, got \['t1', 't2'\]"):
        tct.check_trainer_config(cfg)


def test_teacher_output_that_does_not_line_up_is_an_error():
    from tokencredit.integrations.verl.oracle import response_logprobs, teacher_response_logprobs
    from tokencredit.testing import tiny_model_and_tokenizer

    teacher, _ = tiny_model_and_tokenizer(seed=1)
    prompt, resp = [5, 6, 7], torch.tensor([8, 9, 10, 11])
    with pytest.raises(ValueError, match="teacher_ids of row 0: expected the response's tokens"):
        teacher_response_logprobs(VerlLikeTeacher(teacher, shift=0), [prompt], [resp])  # an unshifted output
    ids, lp = torch.tensor([6, 7, 8, 9, 10, 11, 0])[:, None], torch.zeros(7, 1)
    assert response_logprobs(ids, lp, 3, resp).shape == (4,)
    with pytest.raises(ValueError, match=r"expected 7 rows \(prompt 3 \+ response 4\), got 6"):
        response_logprobs(ids[:6], lp[:6], 3, resp)
    with pytest.raises(ValueError, match=r"expected \[7, 1\].*top-k"):
        response_logprobs(ids.repeat(1, 4), lp.repeat(1, 4), 3, resp)


# -- (4) the critic: loss, global normalisation, IS weights ----------------------------------


def critic_micro_batch(head_out, mask, rm_scores, returns, weights=None, *, batch_num_tokens=None, dp_size=1, prompt_len=3):
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    B, R = mask.shape
    flat = []
    for b in range(B):
        n = int(mask[b].sum())
        flat.append(torch.cat([torch.zeros(prompt_len - 1), head_out[b, :n], torch.zeros(1)]))
    values = torch.cat(flat).requires_grad_(True)
    attn = torch.cat([torch.ones(B, prompt_len, dtype=torch.long), mask.long()], dim=1)
    data = TensorDict({"prompts": torch.ones(B, prompt_len, dtype=torch.long), "responses": torch.ones(B, R, dtype=torch.long),
                       "attention_mask": attn, "response_mask": mask, "returns": returns, "rm_scores": rm_scores}, batch_size=[B])
    if weights is not None:
        data[tcv.CRITIC_WEIGHTS_FIELD] = weights
    tu.assign_non_tensor_data(data, "dp_size", dp_size)
    tu.assign_non_tensor_data(data, "batch_num_tokens", batch_num_tokens)
    tu.assign_non_tensor_data(data, "global_batch_size", None)
    return {"values": values}, data


def test_pact_critic_loss_is_weights_and_global_normalisation():
    tlr, mask, uid, rewards = rollout()
    gen = torch.Generator().manual_seed(9)
    head = torch.randn(mask.shape, generator=gen) * mask
    logp, old = policy_tensors(mask)
    plan = plan_signals(CreditPipeline("pact"), lora=False)
    assert plan.critic.after_actor and plan.critic.transform == "sigmoid"
    w = plan.critic.is_weights(logp, old, mask)
    torch.testing.assert_close(w, pact_critic_is_weights(logp, old, mask))
    assert ((w == 0) & mask.bool()).any() and (w > 0).any()  # some tokens masked, some kept
    settings = tcv.settings_from_dict({"spec": "pact"})
    crit_cfg = None  # tokencredit_value_loss reads no verl critic setting

    out, data = critic_micro_batch(head, mask, tlr, torch.zeros_like(tlr), w)
    loss, metrics = tcv.tokencredit_value_loss(crit_cfg, out, data, settings=settings)
    head_ref = head.clone().requires_grad_(True)
    expected = pact_critic_loss(head_ref, rewards, mask, w)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    loss.backward()
    expected.backward()
    grads = torch.cat([torch.cat([torch.zeros(2), head_ref.grad[b, : int(mask[b].sum())], torch.zeros(1)]) for b in range(len(mask))])
    torch.testing.assert_close(out["values"].grad, grads, rtol=1e-5, atol=1e-8)
    assert "critic/vpred_mean" in metrics

    # two micro-batches, normalised over the global tokens, sum to the whole batch's loss
    n = int(mask.sum())
    parts = []
    for rows in (slice(0, 3), slice(3, None)):
        o, d = critic_micro_batch(head[rows], mask[rows], tlr[rows], torch.zeros_like(tlr[rows]), w[rows], batch_num_tokens=n)
        parts.append(tcv.tokencredit_value_loss(crit_cfg, o, d, settings=settings)[0])
    torch.testing.assert_close(sum(parts), pact_critic_loss(head, rewards, mask, w), rtol=1e-6, atol=1e-7)

    # the after-actor critic refuses a batch without the IS weights
    o, d = critic_micro_batch(head, mask, tlr, torch.zeros_like(tlr))
    with pytest.raises(ValueError, match="tc_critic_weights"):
        tcv.tokencredit_value_loss(crit_cfg, o, d, settings=settings)


def test_gae_critic_loss_regresses_on_the_estimators_returns():
    from tokencredit.credit.methods.gae import gae_critic_loss

    tlr, mask, uid, rewards = rollout()
    head = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    returns = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    out, data = critic_micro_batch(head, mask, tlr, returns)
    loss, _ = tcv.tokencredit_value_loss(None, out, data, settings=tcv.settings_from_dict({"spec": "gae"}))
    torch.testing.assert_close(loss, gae_critic_loss(head, rewards=rewards, returns=returns, mask=mask.bool()), rtol=1e-6, atol=1e-7)


# -- (5) the trainer mode's checks for the new methods ---------------------------------------


#: verl's own on-policy-distillation teacher servers (what a teacher-scored oracle needs)
TEACHER = (
    "distillation.enabled=True",
    "distillation.n_gpus_per_node=1",
    "distillation.nnodes=1",
    "distillation.teacher_models.teacher_model.model_path=Qwen/Qwen2.5-1.5B-Instruct",
    "distillation.distillation_loss.loss_mode=k1",
    "distillation.distillation_loss.use_policy_gradient=True",
)


def _with(adv, *extra):
    return [o for o in TRAINER_OVERRIDES if not o.startswith("algorithm.adv_estimator")] + [f"algorithm.adv_estimator={adv}", *extra]


def test_trainer_config_for_every_seed_method():
    ok = {
        "gtpo": _with("tc_gtpo", "+tokencredit.spec=gtpo"),
        "stare": _with("tc_grpo", "+tokencredit.spec=grpo+stare", "+tokencredit.stare.adaptive=True"),
        "oppo": _with("tc_oppo", "+tokencredit.spec=oppo"),
        "opd": _with("tc_opd", "+tokencredit.spec=opd"),
        "oppo_teacher": _with("tc_oppo", "+tokencredit.spec=oppo", "+tokencredit.oppo.oracle=teacher", *TEACHER),
        "opd_teacher": _with("tc_opd", "+tokencredit.spec=opd", "+tokencredit.opd.oracle=teacher", *TEACHER),
        "pact": _with("tc_pact", "+tokencredit.spec=pact", "critic.enable=True"),
        "gae": _with("tc_gae", "+tokencredit.spec=gae", "critic.enable=True"),
    }
    passes = {}
    for name, overrides in ok.items():
        cfg = compose_verl(overrides)
        settings = tct.check_trainer_config(cfg)
        passes[name] = tct.trainer_plan(cfg, settings)[1].passes
    assert passes["oppo"] == passes["opd"] == passes["oppo_teacher"] == passes["opd_teacher"] == ("policy", "oracle")
    plans = {n: tct.trainer_plan(compose_verl(ok[n]), tct.check_trainer_config(compose_verl(ok[n])))[1] for n in ("oppo", "oppo_teacher", "opd_teacher")}
    assert plans["oppo"].oracle.scorer == "policy" and plans["oppo_teacher"].oracle.scorer == "teacher"
    assert plans["oppo_teacher"].oracle.prompt is not None and plans["opd_teacher"].oracle.prompt is None
    assert passes["pact"] == passes["gae"] == ("policy", "critic")

    bad = [
        (_with("tc_pact", "+tokencredit.spec=pact"), "critic.enable=True"),
        (_with("tc_pact", "+tokencredit.spec=pact", "critic.enable=True", "algorithm.use_kl_in_reward=True"), "use_kl_in_reward=False"),
        (_with("tc_pact", "+tokencredit.spec=pact", "critic.enable=True", "trainer.critic_warmup=2"), "critic_warmup=0"),
        (_with("tc_opd", "+tokencredit.spec=opd", "+tokencredit.opd.oracle=teacher"), "expected distillation.enabled=True"),
        (_with("tc_oppo", "+tokencredit.spec=oppo", *TEACHER), "no teacher-scored pass"),
        (_with("tc_oppo", "+tokencredit.spec=oppo", "+tokencredit.oppo.oracle=teacher", *TEACHER,
               "actor_rollout_ref.rollout.temperature=0.7"), "expected 1.0 with a teacher-scored oracle, got 0.7"),
        (_with("tc_oppo", "+tokencredit.spec=oppo", "+tokencredit.oppo.oracle=teacher", *TEACHER,
               "distillation.distillation_loss.loss_mode=forward_kl_topk"), "non-top-k mode"),
        (_with("grpo", "+tokencredit.spec=gtpo"), "adv_estimator=tc_gtpo"),
        (_with("tc_grpo", "+tokencredit.spec=grpo+acpo"), "mode_prob"),
    ]
    for overrides, match in bad:
        with pytest.raises(ValueError, match=match):
            tct.check_trainer_config(compose_verl(overrides))


# -- (6) the smoke script's dry run ------------------------------------------------------------


def validate(cfg):
    """verl's validate_config; for a LoRA actor with vLLM its last check imports vLLM (absent on
    CPU machines) to read vLLM's allowed ranks: that check runs here against the ranks verl falls
    back to, the rest of validate_config on a copy without the rank."""
    from omegaconf import open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    rank = cfg.actor_rollout_ref.model.get("lora_rank", 0)
    if rank > 0 and cfg.actor_rollout_ref.rollout.name == "vllm":
        assert rank in (1, 8, 16, 32, 64, 128, 256, 320, 512), rank  # verl's fallback MaxLoRARanks
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.actor_rollout_ref.model.lora_rank = 0
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_smoke_script_dry_run_is_accepted_by_verls_config_loader(tmp_path):
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import omega_conf_to_dataclass

    from tokencredit.testing import tiny_model_and_tokenizer

    # verl's critic config reads the model's HF config: a local tiny model stands in for the hub one
    model, tok = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    env = {**os.environ, "DRY_RUN": "1", "MODEL": str(tmp_path / "model")}
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "verl", "smoke.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    methods = {}
    for ln in lines:
        words = shlex.split(ln)
        assert words[:3] == ["python3", "-m", "verl.trainer.main_ppo"], ln
        methods[[w for w in words if w.startswith("trainer.experiment_name=")][0].split("=", 1)[1]] = words[3:]
    assert {f"smoke_{m}" for m in ("grpo", "gtpo", "taco", "stare", "acpo", "arca", "oppo", "opd", "pact", "gae")} <= set(methods)
    for name, overrides in methods.items():
        cfg = compose_verl(overrides)
        assert cfg.actor_rollout_ref.model.path == str(tmp_path / "model")
        validate(cfg)
        omega_conf_to_dataclass(cfg.algorithm)
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        if need_critic(cfg):
            omega_conf_to_dataclass(cfg.critic)
        settings = tct.check_trainer_config(cfg)
        assert cfg.trainer.n_gpus_per_node == 1 and settings.spec, name
        if name == "smoke_arca":  # a LoRA actor with a LoRA-sized step
            assert cfg.actor_rollout_ref.model.lora_rank > 0 and cfg.actor_rollout_ref.actor.optim.lr == 2e-5


EXAMPLES = [
    ("estimators.sh", {"METHOD": "grpo"}), ("estimators.sh", {"METHOD": "dr_grpo"}),
    ("intrinsic.sh", {"SALIENCE": "entropy"}), ("taco.sh", {}), ("stare.sh", {"ADAPTIVE": "True"}),
    ("gtpo.sh", {}), ("oracle.sh", {"METHOD": "oppo"}), ("oracle.sh", {"METHOD": "opd"}),
    ("oracle.sh", {"METHOD": "oppo", "ORACLE": "teacher"}), ("oracle.sh", {"METHOD": "opd", "ORACLE": "teacher"}),
    ("critic.sh", {"METHOD": "pact"}), ("critic.sh", {"METHOD": "gae"}),
    ("worker.sh", {"METHOD": "acpo"}), ("worker.sh", {"METHOD": "arca"}),
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tokencredit.testing import tiny_model_and_tokenizer

    d = tmp_path_factory.mktemp("tiny") / "model"
    model, tok = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("script,env", EXAMPLES, ids=[f"{s}:{','.join(e.values())}" for s, e in EXAMPLES])
def test_launch_examples_dry_run_pass_verls_config_and_the_trainer_checks(script, env, tiny_model_dir):
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import omega_conf_to_dataclass

    out = subprocess.run(["bash", os.path.join(REPO, "examples", "verl", script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env, "DRY_RUN": "1", "MODEL": tiny_model_dir})
    assert out.returncode == 0, out.stderr
    cfg = compose_verl([ln for ln in out.stdout.splitlines() if ln.strip()])
    validate(cfg)
    omega_conf_to_dataclass(cfg.algorithm)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    if need_critic(cfg):
        omega_conf_to_dataclass(cfg.critic)
    if cfg.distillation.enabled:  # verl's own checks of the teacher pool and loss settings
        omega_conf_to_dataclass(cfg.distillation)
        # the teacher's pool is a second pool on the same node (verl's resource pool manager)
        assert cfg.trainer.n_gpus_per_node + cfg.distillation.n_gpus_per_node <= 8
    if cfg.trainer.v1.trainer_mode == "tokencredit_sync":
        tct.check_trainer_config(cfg)
