"""TokenCreditGRPOTrainer: every credit family trains two TRL steps on a tiny random Llama, the
advantages TRL's loss receives are tokencredit's core CreditPipeline output on the captured
batch, the signals match an independent forward pass, STARE's state rides in the checkpoints,
and unsupported setups fail at construction with a message that says why."""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

import trl  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from tokencredit import TOKEN_SIGNALS, CreditPipeline  # noqa: E402
from tokencredit.integrations.trl import (  # noqa: E402
    CREDIT_STATE_NAME,
    TokenCreditGRPOTrainer,
    checkpointing_args,
    checkpointing_field,
)
from tokencredit.testing import tiny_model_and_tokenizer  # noqa: E402

TEMPERATURE = 0.8  # not 1, so that a signal computed without the temperature shows up


class RewardLog:
    """A binary reward that varies with the text; remembers what it returned."""

    __name__ = "crc_reward"

    def __init__(self):
        self.returned = []

    def __call__(self, completions, **kwargs):
        text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        out = [float(zlib.crc32(t.encode()) % 2) for t in text]
        self.returned.append(out)
        return out


def _dataset(n=8, answer_column="answer"):
    return datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{i}+{i % 3}="}], answer_column: str(i + i % 3)} for i in range(n)]
    )


def _args(tmp_path, checkpointing=False, **kw):
    # TRL turns activation checkpointing on by default; its field is gradient_checkpointing in
    # transformers 5.10 and may be activation_checkpointing in newer releases
    base = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=4, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=0, learning_rate=1e-2, temperature=TEMPERATURE, **checkpointing_args(checkpointing),
    )
    base.update(kw)
    return GRPOConfig(**base)


def _lora():
    # init_lora_weights=False: a non-zero B matrix, so the adapter-on and -off passes differ
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _logits(model, ids, att, T):
    return model(input_ids=ids, attention_mask=att).logits[:, -T - 1 : -1].float() / TEMPERATURE


def _token_logprobs(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class Recording(TokenCreditGRPOTrainer):
    """Captures, per generation: the credit state before it, the CreditBatch, the advantages
    handed to TRL, an independent recomputation of every signal; and what the loss received."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records, self.loss_rows = [], []

    def _generate_and_score_completions(self, inputs):
        state = copy.deepcopy(self.credit.state_dict())
        out = super()._generate_and_score_completions(inputs)
        self.records.append(
            {"state": state, "batch": self.last_credit_batch, "out": {k: v for k, v in out.items()},
             "expected": self._expected(out, inputs)}
        )
        return out

    @torch.no_grad()
    def _expected(self, out, inputs):
        """Every signal of the batch, recomputed with plain torch (no tokencredit, no TRL helper)."""
        batch = self.last_credit_batch
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        comp, T = out["completion_ids"], out["completion_ids"].shape[1]
        model = self.accelerator.unwrap_model(self.model)
        exp = {}
        logits = _logits(model, ids, att, T)
        if batch.logprobs is not None:
            exp["logprobs"] = _token_logprobs(logits, comp)
        p = torch.softmax(logits, -1)
        if batch.entropy is not None:
            exp["entropy"] = -(p * torch.log_softmax(logits, -1)).sum(-1)
        if batch.mode_prob is not None:
            exp["mode_prob"] = p.max(-1).values
        if batch.ref_logprobs is not None:
            if self.ref_model is not None:
                exp["ref_logprobs"] = _token_logprobs(_logits(self.ref_model, ids, att, T), comp)
            else:
                with model.disable_adapter():
                    exp["ref_logprobs"] = _token_logprobs(_logits(model, ids, att, T), comp)
        if batch.hidden_residual is not None:
            h_on = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states[-1]
            with model.disable_adapter():
                h_off = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states[-1]
            exp["hidden_residual"] = (h_on - h_off)[:, -T - 1 : -1].float().norm(dim=-1)
        if batch.oracle_logprobs is not None:
            from tokencredit.credit.methods.oppo import oracle_prompt

            tok = self.processing_class
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": oracle_prompt(x["prompt"][-1]["content"], x["answer"])}],
                    tokenize=False, add_generation_prompt=True,
                )
                for x in inputs
            ]
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            o_ids = torch.cat([enc["input_ids"], comp], 1)
            o_att = torch.cat([enc["attention_mask"], out["completion_mask"]], 1)
            scorer = self.oracle_model if self.oracle_model is not None else model
            exp["oracle_logprobs"] = _token_logprobs(_logits(scorer, o_ids, o_att, T), comp)
        return exp

    def _compute_loss(self, model, inputs):
        self.loss_rows.append((inputs["completion_ids"].clone(), inputs["advantages"].clone()))
        return super()._compute_loss(model, inputs)


def _make(tmp_path, credit, *, lora=False, config=None, cls=Recording, model=None, teacher=False, **args):
    if model is None:
        model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    else:
        model, tok = model
    reward = RewardLog()
    extra = {"oracle_model": tiny_model_and_tokenizer(seed=1, eos_bias=2.0)[0]} if teacher else {}
    trainer = cls(
        model=model, reward_funcs=reward, args=_args(tmp_path, **args), train_dataset=_dataset(),
        processing_class=tok, peft_config=_lora() if lora else None, credit=credit, credit_config=config, **extra,
    )
    trainer.reward_log = reward
    return trainer


def _rows(ids, adv):
    return sorted((tuple(i.tolist()), tuple(round(a, 6) for a in r.tolist())) for i, r in zip(ids, adv))


def _check_run(trainer, credit, config=None, steps=2):
    args = trainer.args
    per_gen = args.steps_per_generation  # micro-batches (loss calls) fed by one generation
    assert trainer.state.global_step == steps
    assert len(trainer.records) == steps * args.gradient_accumulation_steps // per_gen
    G = args.per_device_train_batch_size * per_gen  # completions per generation
    nonzero = False
    for rec, returned in zip(trainer.records, trainer.reward_log.returned, strict=True):
        batch, out = rec["batch"], rec["out"]
        adv = out["advantages"]
        B, T = out["completion_ids"].shape
        assert B == G and adv.shape == (B, T) and torch.isfinite(adv).all()
        # the raw rewards and TRL's consecutive groups reach the estimator
        assert batch.rewards.tolist() == returned
        assert batch.group_ids.tolist() == [i // args.num_generations for i in range(B)]
        assert torch.equal(batch.response_mask.bool(), out["completion_mask"].bool())
        # exactly the declared signals are computed, and they match an independent forward pass
        core = CreditPipeline(credit, dict(config or {}))
        # (old_logprobs rides along, checked below; a spec may also declare it: TACO's AR-Lopti)
        present = {s for s in TOKEN_SIGNALS if getattr(batch, s) is not None} - {"old_logprobs"}
        assert present == set(core.required_signals) - {"old_logprobs"}
        assert set(rec["expected"]) == present
        if "old_logprobs" in core.required_signals:
            assert batch.old_logprobs is not None
        # the pre-update log-probs ride along as old_logprobs (AR-Lopti reads them): TRL's
        # generation-time pass when it ran one, else the policy pass's
        trl_old = rec["out"].get("old_per_token_logps")
        if trl_old is not None:
            assert torch.equal(batch.old_logprobs, trl_old.float())
        elif batch.logprobs is not None:
            assert torch.equal(batch.old_logprobs, batch.logprobs)
        else:
            assert batch.old_logprobs is None
        m = batch.mask
        for name, expected in rec["expected"].items():
            got = getattr(batch, name)
            assert torch.allclose(got[m], expected[m], atol=2e-4, rtol=1e-4), name
        # the advantages handed to TRL are the core pipeline's on the same batch and state; the
        # state is the one before this generation, which the controller steps first (STARE's
        # reference order), so the core call steps it too
        core.load_state_dict(rec["state"])
        ref = core(batch).advantages
        assert torch.allclose(adv, ref, atol=1e-6, rtol=0)
        assert (adv[~m] == 0).all()
        nonzero |= bool((adv != 0).any())
    assert nonzero  # some group carried signal: the comparison above is not between zeros
    # TRL's loss received exactly these [B, T] rows (shuffled, split into micro-batches)
    assert len(trainer.loss_rows) == len(trainer.records) * per_gen
    for i, rec in enumerate(trainer.records):
        parts = trainer.loss_rows[i * per_gen : (i + 1) * per_gen]
        assert all(adv.dim() == 2 for _, adv in parts)
        ids = torch.cat([p[0] for p in parts])
        adv = torch.cat([p[1] for p in parts])
        assert _rows(ids, adv) == _rows(rec["out"]["completion_ids"], rec["out"]["advantages"])
    # the methods' metrics (the controller's too) and the credit diagnostics are in TRL's logs
    logged = set(trainer.state.log_history[0])
    expected = set(trainer.last_credit_output.metrics) | {"diag/weight_gini"}
    if trainer.credit.states:
        expected |= set(copy.deepcopy(trainer.credit).update_state(trainer.last_credit_batch))
    assert expected <= logged, expected - logged


# (spec, credit_config, trainer options); configs put the random model where the calibrator acts
FAMILIES = [
    ("grpo", {}, {}),
    ("rloo", {}, {}),
    ("oppo", {}, {}),
    ("taco", {"taco": {"alpha": 2.0}}, {}),  # tail when p < 2 exp(-H): most tokens of a random model
    ("stare", {"stare": {"H_target": 10.0}}, {}),  # a target above the random model's entropy: gate on
    ("acpo", {}, {}),
    ("arca", {}, {"lora": True}),
    ("rloo+arca", {}, {"lora": True}),
    ("divergence", {}, {"lora": True}),
    ("oppo+stare", {"stare": {"H_target": 10.0, "adaptive": True}}, {}),
    ("dr_grpo", {}, {}),
    ("gtpo", {}, {}),
    ("opd", {}, {}),
    ("surprisal", {}, {}),
    ("entropy", {}, {}),
    ("taco", {"taco": {"mode": "ar_lopti"}}, {}),  # reads old_logprobs (declared for that mode only)
    ("oppo+taco", {"oppo": {"oracle": "teacher"}, "taco": {"alpha": 2.0}}, {"teacher": True}),
    ("acpo", {}, {"checkpointing": True}),  # TRL's default: activation checkpointing on
    ("rloo+arca", {}, {"lora": True, "checkpointing": True}),
]
FAMILY_IDS = [f[0] + ("-" + f[1]["taco"]["mode"] if "mode" in f[1].get("taco", {}) else "") + ("-teacher" if f[2].get("teacher") else "") + ("-ckpt" if f[2].get("checkpointing") else "") for f in FAMILIES]


@pytest.mark.parametrize("credit,config,kw", FAMILIES, ids=FAMILY_IDS)
def test_two_steps_match_core_pipeline(tmp_path, credit, config, kw):
    trainer = _make(tmp_path, credit, config=config, **kw)
    assert getattr(trainer.args, checkpointing_field()) is kw.get("checkpointing", False)
    trainer.train()
    _check_run(trainer, credit, config)
    core = CreditPipeline(credit, dict(config))
    if core.calibrators:
        # the calibrator changed the estimator's credit somewhere (the check is not vacuous)
        est = CreditPipeline(core.estimator.name, {k: v for k, v in config.items() if k == core.estimator.name})
        changed = [
            not torch.allclose(rec["out"]["advantages"], est(rec["batch"], update_state=False).advantages)
            for rec in trainer.records
        ]
        assert any(changed)


def test_credit_config_reaches_the_method(tmp_path):
    cfg = {"grpo": {"std_normalize": False}}
    trainer = _make(tmp_path, "grpo", config=cfg)
    trainer.train()
    _check_run(trainer, "grpo", cfg)
    b = trainer.records[-1]["batch"]
    seq = b.rewards - b.rewards.view(-1, 2).mean(1).repeat_interleave(2)  # no std division
    adv = trainer.records[-1]["out"]["advantages"]
    assert torch.allclose(adv, seq.unsqueeze(1) * b.fmask)


def test_divergence_with_trl_reference_model(tmp_path):
    # beta > 0 without PEFT: TRL loads a reference model from the policy's path; its log-probs are reused
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    trainer = _make(tmp_path, "divergence", model=(str(path), tok), beta=0.05)
    assert trainer.ref_model is not None
    trainer.train()
    _check_run(trainer, "divergence")


def test_stare_state_in_checkpoint_and_restored(tmp_path):
    trainer = _make(tmp_path, "grpo+stare", config={"stare": {"adaptive": True}}, save_strategy="steps", save_steps=1)
    trainer.train()
    ckpts = {s: tmp_path / "out" / f"checkpoint-{s}" for s in (1, 2)}
    saved = {s: json.loads((p / CREDIT_STATE_NAME).read_text()) for s, p in ckpts.items()}
    assert saved[1]["spec"] == saved[2]["spec"] == "grpo+stare"
    # the controller moved, so a resume that ignored the file would start from another state
    initial = json.loads(json.dumps(CreditPipeline("grpo+stare", {"stare": {"adaptive": True}}).state_dict()))
    assert saved[1]["state"] != initial and saved[2]["state"] != saved[1]["state"]
    assert saved[2]["state"] == json.loads(json.dumps(trainer.credit.state_dict()))
    # the state saved at step 1 is the one the step-2 credit was computed with
    assert saved[1]["state"] == json.loads(json.dumps(trainer.records[1]["state"]))

    resumed = _make(tmp_path, "grpo+stare", config={"stare": {"adaptive": True}}, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(ckpts[1]))
    assert resumed.state.global_step == 2
    assert json.loads(json.dumps(resumed.records[0]["state"])) == saved[1]["state"]

    other = _make(tmp_path, "oppo+stare", save_strategy="no")
    with pytest.raises(ValueError, match="grpo\\+stare"):
        other.train(resume_from_checkpoint=str(ckpts[1]))


def test_controller_steps_once_per_optimizer_step(tmp_path):
    # two micro-batches per optimizer step: the controller must step twice in two steps, not four times
    trainer = _make(tmp_path, "grpo+stare", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    calls = []
    original = trainer.credit.update_state
    trainer.credit.update_state = lambda batch: calls.append(batch.batch_size) or original(batch)
    trainer.train()
    assert trainer.state.global_step == 2
    assert calls == [4, 4]  # the whole generation batch, once per optimizer step


@pytest.mark.parametrize(
    "credit,extra_passes,kw",
    [
        ("grpo", 0, {}),  # no signal: no forward beyond the loss's
        ("surprisal", 0, {"steps_per_generation": 2}),  # log-probs only: TRL's generation-time pass is reused
        ("surprisal", 1, {}),  # log-probs only, none from TRL: one pass per generation
        ("taco", 1, {}),  # log-probs and entropy: one pass per generation
    ],
    ids=["grpo", "surprisal-reused", "surprisal", "taco"],
)
def test_signals_only_when_declared(tmp_path, credit, extra_passes, kw):
    trainer = _make(tmp_path, credit, **kw)
    trl_calls, passes = [], []
    original = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: trl_calls.append(torch.is_grad_enabled()) or original(*a, **k)
    forward = trainer._signal_forward  # the forward of every signal pass (tokencredit.engine.passes)
    trainer._signal_forward = lambda *a, **k: passes.append(torch.is_grad_enabled()) or forward(*a, **k)
    trainer.train()
    _check_run(trainer, credit)
    n_gen, n_loss = len(trainer.records), len(trainer.loss_rows)
    trl_old = int("old_per_token_logps" in trainer.records[0]["out"])  # TRL's own no-grad pass
    assert trl_old == int(kw.get("steps_per_generation", 1) > 1)
    assert trl_calls.count(True) == n_loss
    assert trl_calls.count(False) == n_gen * trl_old
    # one generation batch is one micro-batch here (per_device_train_batch_size rows)
    assert passes == [False] * (n_gen * extra_passes)
    if trl_old:
        assert trainer.records[0]["batch"].logprobs.equal(trainer.records[0]["out"]["old_per_token_logps"])


@pytest.mark.parametrize("credit", ["gae", "pact", "gae+arca"])
def test_value_methods_are_refused(tmp_path, credit):
    with pytest.raises(ValueError, match=r"(?s)(gae|pact).*critic.*tokencredit's own trainer"):
        _make(tmp_path, credit)


def test_clear_errors_at_construction(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"arca reads the LoRA adapter.*peft_config=LoraConfig.*LlamaForCausalLM"):
        _make(tmp_path, "arca")
    with pytest.raises(ValueError, match="ref_logprobs.*beta"):
        _make(tmp_path, "divergence")
    # a declared need the plan cannot meet, in this trainer's argument names
    with pytest.raises(ValueError, match=r"^oracle_model: .*oppo.oracle='teacher'.*expected a teacher model \(oracle_model="):
        _make(tmp_path, "oppo", config={"oppo": {"oracle": "teacher"}})
    with pytest.raises(ValueError, match=r"^oracle_model: .*unused.*credit_config=\{'oppo': \{'oracle': 'teacher'\}\}"):
        _make(tmp_path, "oppo", teacher=True)
    with pytest.raises(ValueError, match="scale_rewards"):
        _make(tmp_path, "grpo", scale_rewards="none")
    with pytest.raises(ValueError, match="unknown key"):
        _make(tmp_path, "grpo+taco", config={"taco": {"nope": 1}})
    model, tok = tiny_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match="answer_column='solution'"):
        TokenCreditGRPOTrainer(
            model=model, reward_funcs=RewardLog(), args=_args(tmp_path), train_dataset=_dataset(),
            processing_class=tok, credit="oppo", answer_column="solution",
        )
    monkeypatch.delattr(trl.GRPOTrainer, "_calculate_rewards")
    with pytest.raises(RuntimeError, match=rf"_calculate_rewards.*{trl.__version__}"):
        _make(tmp_path, "grpo")


def test_answer_column_name_is_configurable(tmp_path):
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=2.0)
    trainer = TokenCreditGRPOTrainer(
        model=model, reward_funcs=RewardLog(), args=_args(tmp_path, max_steps=1),
        train_dataset=_dataset(answer_column="solution"), processing_class=tok, credit="oppo",
        answer_column="solution",
    )
    trainer.train()
    assert trainer.last_credit_batch.oracle_logprobs is not None


def test_a_trl_run_saves_rollouts_that_inspect_reads(tmp_path):
    """With each checkpoint the last training batch is written as eval/rollouts_step_*.pt, the
    own trainer's format: `tokencredit inspect` replays it with the run's configs and state."""
    from tokencredit.analysis.inspector import load_rollouts, replay, write_page

    model, tok = tiny_model_and_tokenizer(seed=0)
    args = _args(tmp_path, save_strategy="steps", save_steps=2, max_steps=2)
    tr = TokenCreditGRPOTrainer(model=model, processing_class=tok, reward_funcs=RewardLog(), args=args,
                                train_dataset=_dataset(), credit="grpo+taco", credit_config={"taco": {"lam": 0.5}})
    tr.train()
    path = tmp_path / "out" / "eval" / "rollouts_step_00000002.pt"
    saved = load_rollouts(tmp_path / "out")  # a run folder: its newest rollouts file
    assert saved["credit"] == "grpo+taco" and saved["credit_configs"]["taco"]["lam"] == 0.5
    assert torch.equal(saved["advantages"], tr.last_credit_output.advantages.cpu())
    assert saved["questions"][0].endswith("=") and len(saved["texts"]) == saved["advantages"].shape[0]
    insp = replay(saved, ["grpo+taco"], include_saved=False)  # with the run's lam 0.5
    assert torch.allclose(insp.views[0].advantages, saved["advantages"], atol=1e-6)
    page = write_page(str(path), str(tmp_path / "page.html"), methods="grpo+taco")
    assert "the run's own method configs" in Path(page).read_text()
