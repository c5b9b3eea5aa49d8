"""OAR-G (calibrator ``oar``): against a transcription of the authors' defined code (the bi-level
weights of ``calculate_oar_hybrid_weights``, A'_t = A w_t of ``compute_loss``, the saliency of
``calculate_token_importance_gradient``; read with the search tool, re-written here, not
imported) on random inputs at defaults and off them; the defining properties; the saliency pass
on the tiny model; a trainer step; the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokencredit import CreditPipeline
from tokencredit.credit.batch import CreditBatch
from tokencredit.credit.methods.oar import OARConfig, oar
from tokencredit.credit.plan import PlanError, plan_signals
from tokencredit.credit.registry import SaliencyPass, get_method


# -- transcriptions of the authors' code ---------------------------------------------------------
def ref_weights(raw_scores, q, beta, sum_to_L, floor=0.1):
    """``calculate_oar_hybrid_weights``'s body for one response (numpy, float64), its q per response."""
    score_arr = np.array(raw_scores, dtype=np.float64)
    log_score = np.log1p(score_arr)
    min_val, max_val = log_score.min(), log_score.max()
    range_val = max_val - min_val if max_val > min_val else 1.0
    norm = (log_score - min_val) / range_val
    threshold = np.quantile(norm, q)
    weights = np.ones_like(norm)
    low = norm < threshold
    weights[low] = norm[low] / (threshold + 1e-8)
    weights[low] = np.maximum(weights[low], floor)
    high = ~low
    if high.any():
        weights[high] = 1.0 + beta * (norm[high] - threshold) / (1.0 - threshold + 1e-8)
    if sum_to_L:
        L = weights.shape[0]
        denom = weights.sum()
        weights = np.ones_like(weights) if denom <= 0 else weights * (L / (denom + 1e-8))
    return weights


def ref_advantages(seq_adv, scores, lengths, T, q, beta, sum_to_L, answer_tokens=1, floor=0.1):
    """``compute_loss``: advantages [B, 1] * a [B, T] matrix of ones with each response's
    reasoning weights at its first positions (its last ``answer_tokens`` tokens keep 1), masked."""
    B = len(seq_adv)
    out = np.zeros((B, T))
    for b in range(B):
        L = lengths[b]
        full = np.ones(T)
        R = L - answer_tokens
        if R > 0:
            full[:R] = ref_weights(scores[b][:R], q, beta, sum_to_L, floor)
        out[b, :L] = seq_adv[b] * full[:L]
    return out


def ref_gradient_saliency(model, before, reasoning, answer, noise_std=1e-3, eps=1e-12):
    """``calculate_token_importance_gradient`` with ``pfinal_mode="answer_mean"`` on one
    unpadded sequence (no concluding template: the answer follows the reasoning). The noise is
    drawn as ``torch.randn(R, D) * noise_std`` (the authors' ``normal_`` on the reasoning slice
    draws the same numbers)."""
    full = before + reasoning + answer
    ids = torch.tensor([full])
    s, e = len(before), len(before) + len(reasoning)
    A = len(answer)
    L = len(full)

    def pfinal(logits):
        return logits[[p for p in range(L - A - 1, L - 1) if 0 <= p < L], :].mean(dim=0)

    with torch.no_grad():
        p0 = F.softmax(pfinal(model(input_ids=ids).logits[0].float()), dim=-1)
    emb = model.get_input_embeddings()(ids).detach()
    emb.requires_grad_(True)
    noise = torch.zeros_like(emb)
    noise[0, s:e] = torch.randn(e - s, emb.shape[-1]) * noise_std
    logp = F.log_softmax(pfinal(model(inputs_embeds=emb + noise).logits[0].float()), dim=-1)
    J = torch.sum(p0 * (torch.log(p0 + eps) - logp))
    J.backward()
    return (emb.grad[0, s:e] * emb[0, s:e].detach()).sum(-1).abs()


def _batch(seed, B=6, T=12, scale=1.0, constant_adv=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    sal = torch.rand(B, T, generator=g) ** 3 * scale  # skewed, as saliencies are
    sal[1, 2] = sal[1, 3]  # a tie
    rewards = (torch.rand(B, generator=g) > 0.5).float()
    rewards[0], rewards[1] = 1.0, 0.0
    return CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.zeros(B, dtype=torch.long),
                       outcome_saliency=torch.where(mask.bool(), sal, torch.full_like(sal, float("nan")))), lengths


SETTINGS = [
    {},  # defaults: q 0.8, beta 1, sum_to_len, floor 0.1, answer_tokens 1
    {"quantile": 0.5, "beta": 0.5},
    {"quantile": 0.2, "beta": 2.0, "sum_to_len": False},
    {"quantile": 0.95, "beta": 0.0, "floor": 0.3},
    {"quantile": 0.0, "beta": 3.0, "answer_tokens": 3},
    {"quantile": 1.0, "beta": 1.0, "answer_tokens": 2, "sum_to_len": False},
]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("seed", range(4))
def test_oar_equals_the_authors_reshaping_on_random_inputs(setting, seed):
    batch, lengths = _batch(seed, scale=[1.0, 30.0, 1e-3, 5.0][seed])
    cfg = OARConfig(**setting)
    grpo = CreditPipeline("grpo")(batch).advantages
    got = oar(batch, grpo, cfg).advantages
    seq = [float(grpo[b, 0]) for b in range(len(lengths))]
    scores = [batch.outcome_saliency[b].tolist() for b in range(len(lengths))]
    want = ref_advantages(seq, scores, lengths.tolist(), batch.mask.shape[1], cfg.quantile, cfg.beta, cfg.sum_to_len,
                          cfg.answer_tokens, cfg.floor)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
    # through the pipeline: the same
    pipe = CreditPipeline("grpo+oar", {"oar": setting})
    np.testing.assert_allclose(pipe(batch).advantages.double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_the_authors_loop_carries_the_first_threshold_value_over_as_q_and_oar_does_not():
    """The deviation docs/methods.md names: the authors' loop rebinds ``threshold`` (q) to the
    first response's quantile value; the second response then uses that value as its q."""
    rng = np.random.default_rng(0)
    s1, s2 = rng.random(10) ** 3, rng.random(10) ** 3
    q = 0.8
    n1 = np.log1p(s1)
    n1 = (n1 - n1.min()) / (n1.max() - n1.min())
    carried = np.quantile(n1, q)  # what the loop's second iteration reads as q
    w_loop = ref_weights(s2, carried, 1.0, True)
    w_ours = ref_weights(s2, q, 1.0, True)
    assert not np.allclose(w_loop, w_ours)
    batch = CreditBatch(response_mask=torch.ones(1, 11), rewards=torch.ones(1), group_ids=torch.zeros(1, dtype=torch.long),
                        outcome_saliency=torch.tensor([list(s2) + [0.0]], dtype=torch.float32))
    got = oar(batch, torch.ones(1, 11), OARConfig()).token_weights[0, :10].double().numpy()
    np.testing.assert_allclose(got, w_ours, rtol=1e-5)


# -- properties -----------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.get("sum_to_len", True)])
@pytest.mark.parametrize("seed", range(5))
def test_the_total_of_each_response_is_preserved(setting, seed):
    batch, _ = _batch(seed, scale=10.0)
    grpo = CreditPipeline("grpo")(batch).advantages
    out = oar(batch, grpo, OARConfig(**setting)).advantages
    torch.testing.assert_close(out.sum(-1), grpo.sum(-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, grpo)  # and it is reshaped


def test_zero_advantage_gives_zero_and_padding_stays_zero():
    batch, _ = _batch(3)
    zero = torch.zeros_like(batch.mask)
    assert torch.equal(oar(batch, zero, OARConfig()).advantages, zero)
    grpo = CreditPipeline("grpo")(batch).advantages
    out = oar(batch, grpo, OARConfig()).advantages
    assert bool((out[~batch.mask.bool()] == 0).all())


def test_weights_follow_their_tokens_and_the_outcome_token_keeps_its_advantage():
    """A permutation of the reasoning tokens' saliencies permutes their weights the same way;
    the last (outcome) token is untouched; a higher saliency never gets a lower weight; a
    response without reasoning (one token) is unchanged."""
    g = torch.Generator().manual_seed(7)
    T = 9
    s = torch.rand(T, generator=g) ** 2
    perm = torch.randperm(T - 1, generator=g)
    s2 = s.clone()
    s2[: T - 1] = s[: T - 1][perm]
    mask = torch.ones(3, T)
    mask[2, 1:] = 0
    sal = torch.stack([s, s2, s])
    batch = CreditBatch(response_mask=mask, rewards=torch.tensor([1.0, 1.0, 0.0]), group_ids=torch.zeros(3, dtype=torch.long),
                        outcome_saliency=sal)
    adv = torch.full((3, T), 0.5) * mask
    out = oar(batch, adv, OARConfig())
    w = out.token_weights
    torch.testing.assert_close(w[1, : T - 1], w[0, : T - 1][perm])
    assert float(out.advantages[0, T - 1]) == 0.5 and float(out.advantages[1, T - 1]) == 0.5
    order = torch.argsort(s[: T - 1])
    assert bool((w[0, : T - 1][order].diff() >= -1e-6).all())
    assert float(w[0, : T - 1].max()) > 1.0 > float(w[0, : T - 1].min())
    assert float(out.advantages[2, 0]) == 0.5 and bool((out.advantages[2, 1:] == 0).all())


# -- the saliency pass on the tiny model -----------------------------------------------------------
@pytest.mark.parametrize("mbs", [1, 3])
def test_the_saliency_pass_equals_the_authors_gradient_proxy(mbs):
    from tokencredit.engine.saliency import outcome_saliency
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0)
    g = torch.Generator().manual_seed(3)
    V = model.config.vocab_size
    P, T = 5, 8
    prompts = torch.randint(3, V, (3, P), generator=g)
    resp = torch.randint(3, V, (3, T), generator=g)
    att = torch.ones(3, P + T, dtype=torch.long)
    att[1, :2] = 0  # a left-padded prompt
    prompts[1, :2] = tok.pad_token_id
    rmask = torch.ones(3, T, dtype=torch.long)
    rmask[2, 5:] = 0  # a shorter response
    resp[2, 5:] = tok.pad_token_id
    att[:, P:] = rmask
    spec = SaliencyPass(answer_tokens=2, noise_std=1e-2)
    torch.manual_seed(11)
    got = outcome_saliency(spec, model, torch.cat([prompts, resp], 1), att, P, rmask, micro_batch_size=mbs)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient is left behind
    torch.manual_seed(11)
    for b in range(3):
        L = int(rmask[b].sum())
        before = prompts[b][att[b, :P].bool()].tolist()
        want = ref_gradient_saliency(model, before, resp[b, : L - 2].tolist(), resp[b, L - 2 : L].tolist(), noise_std=1e-2)
        torch.testing.assert_close(got[b, : L - 2], want, rtol=2e-3, atol=1e-9)
        assert bool((got[b, L - 2 :] == 0).all())
        assert float(want.max()) > 0
    model.zero_grad(set_to_none=True)


def test_run_passes_runs_the_declared_saliency_pass():
    from tokencredit.engine.passes import PassInputs, PassModels, run_passes
    from tokencredit.testing import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(seed=1)
    model.train()
    pipe = CreditPipeline("grpo+oar", {"oar": {"answer_tokens": 2, "noise_std": 0.01}})
    plan = plan_signals(pipe, lora=False, saliency=True)
    assert plan.passes == ("policy", "saliency") and plan.saliency == SaliencyPass(2, 0.01, 1e-12)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (2, 9), generator=g)
    rmask = torch.ones(2, 5, dtype=torch.long)
    sig = run_passes(plan, PassModels(policy=model), PassInputs(
        input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=4, response_ids=ids[:, 4:], response_mask=rmask),
        temperature=1.0, micro_batch_size=2)
    s = sig["outcome_saliency"]
    assert s.shape == (2, 5) and bool((s[:, :3] > 0).all()) and bool((s[:, 3:] == 0).all())
    assert model.training  # restored (the passes run in eval mode)


# -- a trainer step ----------------------------------------------------------------------------
def test_trainer_trains_a_step_with_grpo_oar(tmp_path):
    from test_trainer import _cfg, _trainer

    cfg = _cfg(tmp_path, "grpo+oar", steps=1, credit_args=("oar.noise_std=0.01",))
    tr = _trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    m = tr.train_step()
    cb = tr._last_batch["credit_batch"]
    assert cb.outcome_saliency is not None and bool((cb.outcome_saliency[cb.mask.bool()] >= 0).all())
    adv = tr._last_batch["credit"].advantages
    assert torch.isfinite(adv).all()
    grpo = CreditPipeline("grpo")(cb.replace(outcome_saliency=None)).advantages
    torch.testing.assert_close(adv.sum(-1), grpo.sum(-1), rtol=1e-4, atol=1e-5)
    assert "oar/boosted_frac" in m
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())


def test_a_lora_run_with_eval_saves_the_saliency_with_its_rollouts(tmp_path):
    """On a LoRA policy (the embeddings inside a peft model), with an eval step whose batch is
    saved for inspect: the run completes, the saved rollouts carry outcome_saliency, and oar
    replayed on them gives the run's credit."""
    from test_trainer import _cfg, _trainer

    from tokencredit.train.records import RolloutsRecord

    cfg = _cfg(tmp_path, "grpo+oar", steps=1, eval_every=1, lora=True)
    cfg.rollout.samples_per_prompt = 4  # so that some group carries signal
    tr = _trainer(cfg)
    tr.train()
    rec = RolloutsRecord.load(tmp_path / "run")
    cb = rec.credit_batch()
    assert cb.outcome_saliency is not None and float(cb.outcome_saliency[cb.mask.bool()].max()) > 0
    replayed = CreditPipeline(rec.credit, rec.credit_configs)(cb).advantages
    assert rec.credit == "grpo+oar" and float(rec.advantages.abs().max()) > 0
    torch.testing.assert_close(replayed, rec.advantages)


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,expected", [
    ("quantile", 1.5, "in [0, 1]"), ("quantile", float("nan"), "in [0, 1]"), ("beta", -0.1, ">= 0"),
    ("floor", 2.0, "in [0, 1]"), ("eps", 0.0, "in (0, 1]"), ("noise_std", -1.0, ">= 0"), ("kl_eps", "x", "in [0, 1]"),
    ("sum_to_len", 1, "a bool"), ("answer_tokens", 0, "an int >= 1"), ("answer_tokens", 1.0, "an int >= 1"),
])
def test_bad_config_values_are_refused_in_one_line(field, value, expected):
    with pytest.raises(ValueError) as e:
        OARConfig(**{field: value})
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"oar {field}: expected") and expected in msg and repr(value) in msg


def test_trl_and_verl_refuse_oar_in_one_line():
    """The TRL subclass and the verl plugin plan without the saliency pass: one-line refusals."""
    with pytest.raises(PlanError) as e:
        plan_signals(CreditPipeline("grpo+oar"), lora=False)
    assert len(str(e.value).splitlines()) == 1
    assert "oar reads outcome_saliency" in str(e.value) and "expected the own trainer" in str(e.value)
    info = get_method("oar")
    assert info.provenance == "reconstructed" and info.kind == "calibrator" and info.requires == {"outcome_saliency"}
    pytest.importorskip("verl")
    from tokencredit.integrations.verl.core import check_supported

    with pytest.raises(ValueError) as e:
        check_supported(CreditPipeline("grpo+oar"))
    assert len(str(e.value).splitlines()) == 1 and "needs 'outcome_saliency'" in str(e.value)


def test_trls_trainer_refuses_oar_in_one_line(tmp_path):
    for mod in ("trl", "peft", "datasets"):
        pytest.importorskip(mod)
    from test_trl import _make

    with pytest.raises(ValueError) as e:
        _make(tmp_path, "grpo+oar")
    assert len(str(e.value).splitlines()) == 1 and "oar reads outcome_saliency" in str(e.value), str(e.value)


def test_bench_accepts_grpo_oar_on_every_task(tmp_path):
    from tokencredit.analysis.bench import SUITE, bench_config, check_runnable
    from tokencredit.analysis.compare import run_config
    from tokencredit.train.trainer import config_plan

    for task in SUITE:
        check_runnable(task, "grpo+oar", tmp_path)
        cfg = run_config(bench_config(task), "grpo+oar", 0, tmp_path / task)
        plan = config_plan(CreditPipeline(cfg.credit, cfg.method_configs()), cfg)
        assert "saliency" in plan.passes and plan.saliency == SaliencyPass()
