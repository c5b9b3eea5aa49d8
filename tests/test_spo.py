"""SPO-chain: the authors' cut points, segment advantages, whitening and probability-masked loss
(transcribed from AIFrameResearch/SPO below) against the estimator on random inputs; the
defining properties; the continuation pass on the tiny model; a trainer step; the refusals
where continuations cannot be sampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokencredit import CreditPipeline
from tokencredit.credit.batch import CreditBatch
from tokencredit.credit.losses import get_policy_loss
from tokencredit.credit.methods.spo import ProbabilityCuts, SPOConfig, spo
from tokencredit.credit.plan import PlanError, plan_signals
from tokencredit.credit.registry import get_method


# -- transcriptions of the authors' code (read, re-written for the test; not imported) ----------
def ref_cutpoints(response_logprobs, interval=5, threshold=0.9):
    """math_episode_generator_with_mc_advantages.py _create_value_estimation_requests: the cut
    points (a cut point c is the state after response token c; -1 is the query alone). The
    authors' threshold is the literal 0.9; a parameter here to test off it."""
    response_probs = np.exp(np.asarray(response_logprobs, dtype=np.float64))
    cutpoints = np.where(response_probs < threshold)[0]
    cutpoints = cutpoints - 1
    cutpoints = cutpoints[::interval]
    return cutpoints


def ref_token_advantages(score, cutpoints, cutpoints_values, response_prob, n_tokens, threshold=0.9):
    """math_episode_generator_with_mc_advantages.py _compute_token_advantages."""
    token_values = [None] * n_tokens
    advantages = [None] * n_tokens
    token_values[-1] = score
    base = None
    cutpoints = list(cutpoints)
    cutpoints_values = list(cutpoints_values)
    if len(cutpoints) == 0:
        return [0] * n_tokens
    if cutpoints[0] == -1:
        base = cutpoints_values[0]
        cutpoints = cutpoints[1:]
        cutpoints_values = cutpoints_values[1:]
    for idx, value in zip(cutpoints, cutpoints_values):
        token_values[idx] = value
    for i in range(len(token_values)):
        if token_values[i] is not None:
            if base is None:
                advantages[i] = 0
            else:
                advantages[i] = token_values[i] - base
            base = token_values[i]
    for i in range(len(token_values) - 1, -1, -1):
        if advantages[i] is None:
            advantages[i] = advantages[i + 1]
    for i in range(len(token_values)):
        if response_prob[i] > threshold:
            advantages[i] = 0
    return advantages


def ref_masked_whiten(values, mask, logprobs=None, threshold=0.9):
    """trainers/utils.py masked_whiten(shift_mean=True, unbiased_variance=True), one process."""
    mask_bak = mask
    if logprobs is not None:
        mask = mask & (torch.exp(logprobs) < threshold)
    if mask.sum() == 0:
        mask = mask_bak
    m = mask.to(values.dtype)
    mean = (values * m).sum() / m.sum()
    var = (((values - mean) ** 2) * m).sum() / m.sum()
    var = var * (m.sum() / (m.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def ref_actor_loss(logprobs, old_logprobs, advantages, mask, use_prob_mask=True, threshold=0.9, cliprange=0.2):
    """trainers/ppo_trainer.py _compute_actor_loss (no KL term): the PPO-clip loss, masked_mean over
    the action mask, which use_prob_mask narrows to the tokens with exp(old_logprobs) < 0.9."""
    action_mask = mask
    if use_prob_mask:
        action_mask = action_mask & (torch.exp(old_logprobs) < threshold)
    log_ratio = (logprobs - old_logprobs) * action_mask
    ratio = torch.exp(torch.clamp(log_ratio, -10.0, 10.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg = torch.max(pg1, pg2)
    m = action_mask.to(pg.dtype)
    return (pg * m).sum() / m.sum()


# -- random cases ------------------------------------------------------------------------------
def _logprobs(rng, T, high_frac=0.4):
    """Log-probs of T sampled tokens: about high_frac of them confident (p in (0.9, 1), or exactly 1:
    at the threshold 1.0 a token neither cut nor zeroed), the rest anywhere in (0.01, 0.95)."""
    p = np.where(rng.random(T) < high_frac, rng.uniform(0.9001, 0.9999, T), rng.uniform(0.01, 0.95, T))
    p = np.where(rng.random(T) < 0.15, 1.0, p)
    return np.log(p)


def _random_case(rng, thr, interval, B=6, T=17):
    """A batch as the continuation pass leaves it (step_starts at the declared cut rule's points,
    mc_values = the segment's start value, a value also at 0 when token 0 is no cut point: the
    pass samples every segment's start), and the authors' token advantages of the same values."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    lp = torch.zeros(B, T, dtype=torch.float64)
    starts = torch.zeros(B, T, dtype=torch.float64)
    mc = torch.zeros(B, T, dtype=torch.float64)
    rewards = torch.tensor([float(rng.integers(0, 2)) for _ in range(B)], dtype=torch.float64)
    ref = torch.zeros(B, T, dtype=torch.float64)
    rule = ProbabilityCuts(thr, interval)
    for b in range(B):
        L = int(rng.integers(1, T + 1))
        mask[b, :L] = True
        lp[b, :L] = torch.from_numpy(_logprobs(rng, L))
        lp[b, L:] = float("nan") if b % 2 else 0.0  # padding: anything
        cuts = rule([""] * L, lp[b, :L])
        ends = cuts[1:] + [L]
        v = {s: float(rng.integers(0, 10)) / 9 for s in cuts}  # V(y_{<s}) at each segment's start
        for s, e in zip(cuts, ends):
            starts[b, s] = 1.0
            mc[b, s:e] = v[s]
        cps = ref_cutpoints(lp[b, :L].numpy(), interval, thr)
        vals = [v[int(c) + 1] for c in cps]  # the authors' value at cut point c is that of y_{<c+1}
        adv = ref_token_advantages(float(rewards[b]), cps, vals, np.exp(lp[b, :L].numpy()), L, thr)
        ref[b, :L] = torch.tensor(adv, dtype=torch.float64)
    cb = CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.arange(B), logprobs=lp, mc_values=mc, step_starts=starts)
    return cb, ref


CASES = [  # (threshold, interval, prob_mask, whiten): the defaults first
    (0.9, 5, True, True), (0.9, 5, False, True), (0.9, 1, True, False), (0.9, 2, False, False),
    (0.5, 3, True, True), (0.99, 7, True, True), (0.95, 1, False, True), (1.0, 2, False, False), (1.0, 5, True, True),
]


@pytest.mark.parametrize("interval", [1, 2, 5, 9])
@pytest.mark.parametrize("thr", [0.9, 0.5, 0.99, 1.0])
def test_cut_points_are_the_authors(thr, interval):
    """Segment starts = the authors' cut points + 1 (the token after the state), and token 0."""
    rng = np.random.default_rng(11)
    rule = ProbabilityCuts(thr, interval)
    for _ in range(60):
        T = int(rng.integers(1, 40))
        lp = _logprobs(rng, T, high_frac=float(rng.uniform(0, 0.9)))
        ref = ref_cutpoints(lp, interval, thr)
        assert rule([""] * T, torch.from_numpy(lp)) == sorted({0} | {int(c) + 1 for c in ref})


@pytest.mark.parametrize("thr,interval,prob_mask,whiten", CASES)
def test_estimator_and_loss_equal_the_authors(thr, interval, prob_mask, whiten):
    """The authors' token advantages, their whitening over the probability mask and their actor
    loss (masked_mean over the tokens with p < 0.9) equal SPO's advantages in a token-mean PPO loss
    over every valid token, in value and gradient; without the mask the advantages are equal."""
    rng = np.random.default_rng(5)
    cfg = SPOConfig(threshold=thr, interval=interval, prob_mask=prob_mask, whiten=whiten)
    for i in range(12):
        cb, ref = _random_case(rng, thr, interval)
        m = cb.mask
        old = torch.where(m, cb.logprobs, torch.zeros_like(cb.logprobs))
        if whiten:
            ref = ref_masked_whiten(ref, m, old if prob_mask else None, thr)
        ref = torch.where(m, ref, torch.zeros_like(ref))
        out = spo(cb, cfg)
        if not prob_mask:
            torch.testing.assert_close(out.advantages, ref, atol=1e-12, rtol=1e-12)
        g = torch.Generator().manual_seed(i)
        lp = old + 0.1 * torch.randn(old.shape, generator=g, dtype=torch.float64)
        x = lp.clone().requires_grad_(True)
        ours, _ = get_policy_loss("ppo")(x, old, out.advantages, m, {"clip_low": 0.2, "clip_high": 0.2, "agg_mode": "token-mean"})
        (g_ours,) = torch.autograd.grad(ours, x)
        y = lp.clone().requires_grad_(True)
        theirs = ref_actor_loss(y, old, ref, m, prob_mask, thr)
        (g_theirs,) = torch.autograd.grad(theirs, y)
        if prob_mask and not bool((m & (torch.exp(old) < thr)).any()):
            continue  # the authors' masked_mean is 0/0 there; SPO's credit is 0 (docs/methods.md)
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(torch.where(m, g_ours, 0.0), torch.where(m, g_theirs, 0.0), atol=1e-12, rtol=1e-10)


def test_segment_advantages_telescope_to_the_outcome_minus_the_first_cut_value():
    """The defining line, A_seg = V(end) - V(start) with V = R after the last segment: summed over
    a response's segments (one token each, the first a cut point), the credit is R - V(y_{<0})."""
    rng = np.random.default_rng(3)
    B, T = 16, 9
    mask = torch.ones(B, T, dtype=torch.bool)
    lp = torch.full((B, T), float(np.log(0.5)), dtype=torch.float64)  # every token a cut point candidate
    starts = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        starts[b, 0] = 1.0
        starts[b, sorted(rng.choice(np.arange(1, T), size=int(rng.integers(0, T)), replace=False).tolist())] = 1.0
    mc = torch.from_numpy(rng.integers(0, 10, (B, T)) / 9).double()
    seg = starts.long().cumsum(1) - 1
    mc = torch.stack([mc[b][starts[b].bool()][seg[b]] for b in range(B)])  # constant over each segment
    R = torch.from_numpy(rng.integers(0, 2, B).astype(float))
    cb = CreditBatch(response_mask=mask, rewards=R, group_ids=torch.arange(B), logprobs=lp, mc_values=mc, step_starts=starts)
    a = spo(cb, SPOConfig(whiten=False, prob_mask=False)).advantages
    per_row = (a * starts).sum(1)
    torch.testing.assert_close(per_row, R - mc[:, 0], atol=1e-12, rtol=0)
    assert (starts.sum(1) > 2).any()
    # and each token carries its segment's advantage: the next segment's value minus its own
    nxt = torch.cat([mc[:, 1:], R[:, None]], 1)
    last = torch.cat([starts[:, 1:].bool(), torch.ones(B, 1, dtype=torch.bool)], 1)  # a segment's last token
    torch.testing.assert_close(a[last], (nxt - mc)[last], atol=1e-12, rtol=0)


def test_probability_mask_gives_no_gradient_to_confident_tokens_and_averages_over_the_rest():
    """The probability mask: in a token-mean loss over every valid token, a token with p >= theta
    has no gradient, and the loss is the mean over the kept tokens (their count, not the batch's)."""
    rng = np.random.default_rng(8)
    cb, _ = _random_case(rng, 0.9, 1, B=8, T=15)
    m = cb.mask
    old = torch.where(m, cb.logprobs, torch.zeros_like(cb.logprobs))
    kept = m & (torch.exp(old) < 0.9)
    assert kept.any() and (m & ~kept).any()
    out = spo(cb, SPOConfig(interval=1))
    x = (old + 0.05).clone().requires_grad_(True)
    loss, _ = get_policy_loss("ppo")(x, old, out.advantages, m, {"agg_mode": "token-mean"})
    (gx,) = torch.autograd.grad(loss, x)
    assert bool((gx[m & ~kept] == 0).all()) and bool((gx[kept] != 0).any())
    unmasked = spo(cb, SPOConfig(interval=1, prob_mask=False)).advantages  # whitened over every token
    white = spo(cb, SPOConfig(interval=1, whiten=False)).advantages
    torch.testing.assert_close(out.token_weights[kept], torch.full_like(out.token_weights[kept], m.sum() / kept.sum()))
    assert not torch.allclose(out.advantages[kept] * kept.sum() / m.sum(), unmasked[kept])  # whitening stats on the kept tokens
    assert white[kept].abs().sum() > 0


def test_first_segment_without_a_cut_point_gets_no_credit():
    """Tokens before the first low-probability token have no value of their own (the authors take
    none there): their advantage is 0 whatever V(y_{<0}) the pass returned, also where the zeroing
    of confident tokens (p > theta) does not reach them (p = theta)."""
    lp = torch.log(torch.tensor([[0.95, 0.97, 0.5, 0.99, 0.3, 0.4]], dtype=torch.float64))
    starts = torch.tensor([[1.0, 0, 1, 0, 0, 0]], dtype=torch.float64)
    assert ProbabilityCuts(0.9, 5)([""] * 6, lp[0]) == [0, 2]
    mc = torch.tensor([[0.7, 0.7, 0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    cb = CreditBatch(response_mask=torch.ones(1, 6, dtype=torch.bool), rewards=torch.tensor([1.0], dtype=torch.float64),
                     group_ids=torch.tensor([0]), logprobs=lp, mc_values=mc, step_starts=starts)
    a = spo(cb, SPOConfig(whiten=False, prob_mask=False)).advantages[0].tolist()
    assert a == [0.0, 0.0, 0.75, 0.0, 0.75, 0.75]  # segment [2, 6): R - V = 0.75, zero at p = 0.99
    # with token 0 a cut point its segment starts at V(y_{<0}): A = V(y_{<2}) - V(y_{<0})
    cb0 = cb.replace(logprobs=torch.log(torch.tensor([[0.5, 0.97, 0.5, 0.99, 0.3, 0.4]], dtype=torch.float64)))
    assert spo(cb0, SPOConfig(whiten=False, prob_mask=False, interval=2)).advantages[0, 0].item() == pytest.approx(0.25 - 0.7)
    # a token at exactly the threshold (p = 1 = theta) is neither a cut point nor zeroed: before the
    # first cut point it still gets 0, after it its segment's advantage
    cb1 = cb.replace(logprobs=torch.log(torch.tensor([[1.0, 1.0, 0.5, 1.0, 0.3, 0.4]], dtype=torch.float64)))
    assert spo(cb1, SPOConfig(whiten=False, prob_mask=False, threshold=1.0)).advantages[0].tolist() == [0.0, 0.0] + [0.75] * 4


@pytest.mark.parametrize("kw,msg", [
    ({"threshold": 1.5}, "spo threshold: expected a probability in (0, 1], got 1.5"),
    ({"interval": 0}, "spo interval: expected an int >= 1, got 0"),
    ({"k": 0}, "spo k: expected an int >= 1, got 0"),
    ({"prob_mask": "yes"}, "spo prob_mask: expected a bool, got 'yes'"),
])
def test_bad_config_is_one_line(kw, msg):
    with pytest.raises(ValueError) as e:
        CreditPipeline("spo", {"spo": kw})
    assert str(e.value) == msg


# -- the continuation pass on the tiny model --------------------------------------------------
def test_the_pass_cuts_at_the_policys_low_probability_tokens_and_v_is_the_mean_of_k_scored_continuations():
    from tokencredit.engine.continuations import sample_continuations
    from tokencredit.engine.passes import PassInputs, PassModels, run_passes, update_gives
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=0)
    g = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    P, T = 4, 7
    prompts = torch.randint(3, V, (3, P), generator=g)
    resp = torch.randint(3, V, (3, T), generator=g)
    rmask = torch.ones(3, T, dtype=torch.long)
    rmask[2, 4:] = 0
    resp[2, 4:] = tok.pad_token_id
    inp_ids = torch.cat([prompts, resp], 1)
    att = torch.cat([torch.ones(3, P, dtype=torch.long), rmask], 1)
    # the tiny random policy gives every token about 1/V: a threshold at 1.3/V makes some tokens "confident"
    thr = 1.3 / V
    pipe = CreditPipeline("spo", {"spo": {"k": 3, "threshold": thr, "interval": 2}})
    plan = plan_signals(pipe, lora=False, continuations=True)
    assert plan.passes == ("policy", "continuations") and plan.continuations.reads_logprobs and update_gives(plan, 1) == ()
    seen = []

    def sample(prefixes, k, budgets):
        out = sample_continuations(model, prefixes, k, budgets, stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, temperature=1.0)
        seen.append((prefixes, out))
        return out

    score = lambda b, rs: [float(sum(r) % 3) / 2 for r in rs]  # noqa: E731  a reward of the whole response
    torch.manual_seed(0)
    sig = run_passes(plan, PassModels(policy=model), PassInputs(
        input_ids=inp_ids, attention_mask=att, prompt_len=P, response_ids=resp, response_mask=rmask, decode=tok.decode,
        sample=sample, continuation_rewards=score, budget=T), temperature=1.0, micro_batch_size=2)
    rule = ProbabilityCuts(thr, 2)
    prefixes, conts = seen[0]
    n_cuts = 0
    for b in range(3):
        L = int(rmask[b].sum())
        cuts = rule([""] * L, sig["logprobs"][b, :L])
        assert sig["step_starts"][b, :L].nonzero().flatten().tolist() == cuts
        for s, e in zip(cuts, cuts[1:] + [L]):
            pre = prompts[b].tolist() + resp[b, :s].tolist()
            i = prefixes.index(pre)
            assert len(conts[i]) == 3
            want = float(np.mean(score(b, [resp[b, :s].tolist() + c for c in conts[i]])))
            assert sig["mc_values"][b, s:e].tolist() == pytest.approx([want] * (e - s))
        n_cuts += len(cuts)
    assert n_cuts > 3  # some responses are cut in several segments
    assert (torch.exp(sig["logprobs"][rmask.bool()]) >= thr).any()  # and some tokens are confident
    out = pipe(CreditBatch(response_mask=rmask, rewards=torch.tensor([1.0, 0.0, 1.0]), group_ids=torch.tensor([0, 0, 1]),
                           logprobs=sig["logprobs"], mc_values=sig["mc_values"], step_starts=sig["step_starts"]))
    assert torch.isfinite(out.advantages).all()


def test_trainer_trains_a_step_with_spo(tmp_path):
    """The own trainer with its defaults (one PPO epoch, optim.one_pass): the policy pass runs
    before the continuations, whose cut rule reads its log-probs (the update's forward cannot)."""
    from test_trainer import _cfg, _trainer

    thr = 0.0105  # the tiny random policy gives its 99 tokens about 1/99 each: some above, some below
    cfg = _cfg(tmp_path, "spo", steps=1, credit_args=("spo.k=2", "spo.interval=2", f"spo.threshold={thr}"))
    assert cfg.optim.one_pass and cfg.optim.ppo_epochs == 1
    tr = _trainer(cfg)
    assert tr.model.config.vocab_size == 99
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    m = tr.train_step()
    cb = tr._last_batch["credit_batch"]
    assert cb.mc_values is not None and bool((cb.step_starts[:, 0] == 1).all())
    rule = ProbabilityCuts(thr, 2)
    p = torch.exp(cb.logprobs[cb.mask.bool()])
    assert bool((p < thr).any()) and bool((p >= thr).any())
    for b in range(cb.mask.shape[0]):  # the cuts are the rule's on the log-probs the credit reads
        L = int(cb.mask[b].sum())
        assert cb.step_starts[b, :L].nonzero().flatten().tolist() == rule([""] * L, cb.logprobs[b, :L])
    assert torch.isfinite(tr._last_batch["credit"].advantages).all()
    assert "spo/segments_mean" in m and m["spo/segments_mean"] >= 1
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())


def test_trl_and_verl_refuse_spo_in_one_line():
    """The TRL subclass and the verl plugin plan without continuations: the plan refuses it."""
    with pytest.raises(PlanError) as e:
        plan_signals(CreditPipeline("spo"), lora=False)
    assert len(str(e.value).splitlines()) == 1
    assert "spo reads mc_values" in str(e.value) and "expected the own trainer" in str(e.value)
    info = get_method("spo")
    assert info.provenance == "ref-code" and info.loss_defaults == {"agg_mode": "token-mean"}
    c = plan_signals(CreditPipeline("spo"), lora=False, continuations=True).continuations
    assert (c.k, c.max_steps, c.cuts) == (9, None, ProbabilityCuts(0.9, 5))
    pytest.importorskip("verl")
    from tokencredit.integrations.verl.core import check_supported

    with pytest.raises(ValueError) as e:
        check_supported(CreditPipeline("spo"))
    assert len(str(e.value).splitlines()) == 1 and "estimator 'spo' needs" in str(e.value)


def test_trls_trainer_refuses_spo_in_one_line(tmp_path):
    for mod in ("trl", "peft", "datasets"):
        pytest.importorskip(mod)
    from test_trl import _make

    with pytest.raises(ValueError) as e:
        _make(tmp_path, "spo")
    assert len(str(e.value).splitlines()) == 1 and "spo reads mc_values" in str(e.value), str(e.value)


def test_bench_accepts_spo_on_every_task(tmp_path):
    """`tokencredit bench --credit spo` plans on the controlled tasks (the own trainer, the task's
    reward): no refusal before the runs, and the plan runs the policy pass then the declared
    continuations (a 1-seed --quick keytok run trains it: docs/benchmark.md)."""
    from tokencredit.analysis.bench import SUITE, bench_config, check_runnable
    from tokencredit.analysis.compare import run_config
    from tokencredit.train.trainer import config_plan

    for task in SUITE:
        check_runnable(task, "spo", tmp_path)
        cfg = run_config(bench_config(task), "spo", 0, tmp_path / task)
        plan = config_plan(CreditPipeline(cfg.credit, cfg.method_configs()), cfg)
        assert plan.passes == ("policy", "continuations") and plan.continuations.cuts == ProbabilityCuts(0.9, 5)
