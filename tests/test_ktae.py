"""KTAE: key-token scores from a group's rollout statistics, against the authors' code
(xiaolizh1/KTAE, compute_key_tokens.py and core_algos.py) and against a hand case from the
paper's definitions.

The reference below is written from reading the authors' code, one token at a time, with the
Fisher exact test in exact rational arithmetic (math.comb and fractions), so it shares nothing
with the vectorised implementation but the definitions.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.ktae import KTAEConfig, fisher_exact_two_sided, ktae

from helpers import make_batch, pad_batch


def ref_fisher(a, b, c, d):
    """Two-sided p-value, exactly: the tables with the same margins no more likely than (a, b, c, d)."""
    r1, c1, n = a + b, a + c, a + b + c + d

    def prob(k):
        return Fraction(math.comb(c1, k) * math.comb(n - c1, r1 - k), math.comb(n, r1))

    obs = prob(a)
    return sum((prob(k) for k in range(max(0, r1 + c1 - n), min(r1, c1) + 1) if prob(k) <= obs), Fraction(0))


def ref_fisher_term_float32(tables):
    """The reference's Fisher term of each row [a, b, c, d] of ``tables`` (float32 [N, 4]; rows of
    zeros for the ids absent from the group, as the reference's table of every id up to the
    largest): its vectorised ``fisher_exact_test`` (one k grid as wide as the largest min(a + b,
    a + c) + 1, tables kept where ``p_k <= p_obs`` exactly, summed in float32), then
    ``exp(-2 p)`` where ``p != 1.0``, else 0."""
    a, b, c, d = tables.unbind(1)
    R1, C1, n = a + b, a + c, a + b + c + d
    k_min = torch.clamp(R1 + C1 - n, min=0)
    k_max = torch.minimum(R1, C1)
    grid = torch.arange(int(k_max.max()) + 1, dtype=torch.float32).repeat(tables.shape[0], 1)
    inside = (grid >= k_min[:, None]) & (grid <= k_max[:, None])

    def log_comb(N, K):
        return torch.lgamma(N + 1) - torch.lgamma(K + 1) - torch.lgamma(N - K + 1)

    p_k = torch.exp(log_comb(C1[:, None], grid) + log_comb((n - C1)[:, None], R1[:, None] - grid)
                    - log_comb(n, R1)[:, None]) * inside.float()
    p_obs = torch.exp(log_comb(C1, a) + log_comb(n - C1, R1 - a) - log_comb(n, R1))
    p = torch.where((p_k <= p_obs[:, None]) & inside, p_k, torch.tensor(0.0)).sum(1)
    return torch.where(p != 1.0, torch.exp(-2 * p), torch.tensor(0.0))


def ref_group_scores(rows, correct, *, alpha=1.0, beta=1.0, tf=True, k1=2.0, b=0.5, top=1.0, rule="float32"):
    """{token id: score} for one group: rows are lists of valid token ids, correct a list of bools.
    ``rule``: the Fisher term as the reference computes it ("float32") or exactly ("exact")."""
    if all(correct) or not any(correct):
        return {y: 0.0 for r in rows for y in r}
    C = [r for r, ok in zip(rows, correct) if ok]
    W = [r for r, ok in zip(rows, correct) if not ok]
    top_id = max(y for r in rows for y in r)
    table = torch.zeros(top_id + 1, 4, dtype=torch.float32)
    for y in {y for r in rows for y in r}:
        a_, b_ = sum(y in r for r in C), sum(y in r for r in W)
        table[y] = torch.tensor([a_, b_, len(C) - a_, len(W) - b_], dtype=torch.float32)
    term32 = ref_fisher_term_float32(table).tolist()
    Lc, Lw = sum(map(len, C)), sum(map(len, W))
    avg = (Lc + Lw) / 2
    Kc, Kw = k1 * (1 - b + b * Lc / avg), k1 * (1 - b + b * Lw / avg)

    def H(ps):
        return -sum(p * math.log2(p) for p in ps if p > 0)

    out = {}
    for y in sorted({y for r in rows for y in r}):
        a_, b_ = sum(y in r for r in C), sum(y in r for r in W)
        c_, d_ = len(C) - a_, len(W) - b_
        n = len(rows)
        if rule == "exact":
            p = ref_fisher(a_, b_, c_, d_)
            fisher = 0.0 if p == 1 else math.exp(-2 * float(p))
        else:
            fisher = term32[y]
        ig = H([len(C) / n, len(W) / n])
        for x1, x2 in ((a_, b_), (c_, d_)):
            if x1 + x2:
                ig -= (x1 + x2) / n * H([x1 / (x1 + x2), x2 / (x1 + x2)])
        # Cohen's h; the authors' code adds 1e-10 to each denominator (near a proportion of 1
        # that moves h by ~1e-5)
        x = math.asin(math.sqrt(a_ / (len(C) + 1e-10))) - math.asin(math.sqrt(b_ / (len(W) + 1e-10)))
        if tf:
            fc = sum(r.count(y) for r in C) / Lc
            fw = sum(r.count(y) for r in W) / Lw
            tc, tw = fc * (k1 + 1) / (fc + Kc), fw * (k1 + 1) / (fw + Kw)
            x += tc / (tw + 1e-5) - tw / (tc + 1e-5)
        key = (alpha * fisher + beta * ig) * x / (alpha + beta)
        out[y] = math.tanh(key / 2) * top  # = (sigmoid(key) - 0.5) * 2 * top, without overflow
    return out


def ref_advantages(batch: CreditBatch, **kw):
    R = batch.rewards.double()
    ids, m, g = batch.token_ids.long(), batch.mask, batch.group_ids
    adv = torch.zeros(m.shape, dtype=torch.float64)
    for gid in g.unique().tolist():
        idx = (g == gid).nonzero().squeeze(1).tolist()
        rg = R[idx]
        base = (rg - rg.mean()) / (rg.std() + 1e-6)  # torch.std: unbiased, as the reference
        rows = [ids[i][m[i]].tolist() for i in idx]
        s = ref_group_scores(rows, [bool(R[i] > 0) for i in idx], **kw)
        for j, i in enumerate(idx):
            for t in range(m.shape[1]):
                if m[i, t]:
                    adv[i, t] = base[j] + s[int(ids[i, t])]
    return adv


def _random_batch(seed, B=8, T=9, V=6, group=4):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    mask[0, 0] = True
    ids = torch.randint(0, V, (B, T), generator=gen)
    R = torch.randint(0, 2, (B,), generator=gen).double()
    R[seed % B] = 1.0 - R[seed % B] if seed % 3 else R[seed % B]
    return CreditBatch(response_mask=mask, rewards=R, group_ids=torch.arange(B) // group * 3,
                       token_ids=torch.where(mask, ids, torch.full_like(ids, 99999)))


@pytest.mark.parametrize("rule", ["float32", "exact"])
@pytest.mark.parametrize("seed", range(12))
def test_equals_the_authors_definition_at_defaults_on_random_groups(seed, rule):
    batch = _random_batch(seed)
    out = ktae(batch, KTAEConfig() if rule == "float32" else KTAEConfig(p_one_rule=rule))
    torch.testing.assert_close(out.advantages.double(), ref_advantages(batch, rule=rule), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rule", ["float32", "exact"])
@pytest.mark.parametrize("kw", [dict(alpha=0.0), dict(beta_ig=0.0), dict(tf_term=False), dict(beta_ig=2.0, top=0.5),
                                dict(k1=1.2, b=0.75)])
def test_equals_the_authors_definition_off_defaults(kw, rule):
    batch = _random_batch(5, B=12, V=4, group=6)
    ref_kw = {"alpha": kw.get("alpha", 1.0), "beta": kw.get("beta_ig", 1.0), "tf": kw.get("tf_term", True),
              "top": kw.get("top", 1.0), "k1": kw.get("k1", 2.0), "b": kw.get("b", 0.5), "rule": rule}
    torch.testing.assert_close(ktae(batch, KTAEConfig(p_one_rule=rule, **kw)).advantages.double(),
                               ref_advantages(batch, **ref_kw), rtol=1e-9, atol=1e-9)


def test_the_p_one_rules_on_the_issues_example():
    """Token 6 is in one correct and one wrong response of four: the table [[1, 1], [1, 1]], exact
    p = 1. The reference's float32 sum 1/6 + 2/3 + 1/6 falls just below 1.0, so it keeps a Fisher
    term of about exp(-2) (advantage 0.9106); the exact rule has none (0.8660, GRPO's, since
    token 6's Cohen's h and information gain are 0 and only the BM25 ratio is left to multiply)."""
    ids = torch.tensor([[6, 6, 5], [5, 7, 9], [6, 8, 9], [8, 9, 9]])
    batch = CreditBatch(response_mask=torch.ones(4, 3, dtype=torch.bool), rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]),
                        group_ids=torch.zeros(4, dtype=torch.long), token_ids=ids)
    ref = ktae(batch, KTAEConfig()).advantages
    exact = ktae(batch, KTAEConfig(p_one_rule="exact")).advantages
    assert float(ref[0, 0]) == pytest.approx(0.9106, abs=5e-5) and float(exact[0, 0]) == pytest.approx(0.8660, abs=5e-5)
    assert float(ref[2, 0]) == pytest.approx(-0.8214, abs=5e-5) and float(exact[2, 0]) == pytest.approx(-0.8660, abs=5e-5)
    assert KTAEConfig().p_one_rule == "float32"  # the authors' code's rule is the default
    # (float32 rewards: float32 advantages)
    torch.testing.assert_close(ref.double(), ref_advantages(batch), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(exact.double(), ref_advantages(batch, rule="exact"), rtol=1e-6, atol=1e-6)


def test_fisher_exact_known_values():
    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    p, one = fisher_exact_two_sided(t(3.0, 8.0, 1.0), t(0.0, 2.0, 3.0), t(0.0, 1.0, 1.0), t(3.0, 5.0, 3.0))
    # [[3, 0], [0, 3]]: 2 / 20; [[8, 2], [1, 5]]: 0.03497 (R's fisher.test); [[1, 3], [1, 3]]: 1
    torch.testing.assert_close(p, t(0.1, 0.034965034965, 1.0), rtol=1e-9, atol=1e-9)
    assert one.tolist() == [False, False, True]
    assert float(ref_fisher(8, 2, 1, 5)) == pytest.approx(0.034965034965)


def test_hand_case_from_the_definitions():
    """Two correct responses share token 5, the two wrong ones token 9; 7 is everywhere, 1 and 2
    once in each outcome. Without the term-frequency part the score of 5 is, by hand:
    Fisher p of [[2, 0], [0, 2]] = 1/6 + 1/6, information gain 1 bit, Cohen's h = pi / 2."""
    ids = torch.tensor([[5, 7, 1], [5, 7, 2], [9, 7, 1], [9, 7, 2]])
    batch = CreditBatch(response_mask=torch.ones(4, 3), rewards=torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64),
                        group_ids=torch.zeros(4, dtype=torch.long), token_ids=ids)
    key = (math.exp(-2 / 3) + 1.0) * (math.pi / 2) / 2
    s5 = 2 / (1 + math.exp(-key)) - 1
    base = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # (R - 0.5) / (unbiased std + eps)
    adv = ktae(batch, KTAEConfig(tf_term=False)).advantages
    expect = torch.tensor([[base + s5, base, base], [base + s5, base, base],
                           [-base - s5, -base, -base], [-base - s5, -base, -base]], dtype=torch.float64)
    # (the authors' 1e-10 in Cohen's h moves asin(1) = pi / 2 by 7e-6)
    torch.testing.assert_close(adv, expect, rtol=0, atol=2e-5)
    # with the BM25 part (the default) 5 and 9 saturate at +-top, the shared tokens stay at 0
    adv = ktae(batch, KTAEConfig()).advantages
    assert adv[0, 0] - base == pytest.approx(1.0, abs=1e-4) and adv[2, 0] + base == pytest.approx(-1.0, abs=1e-4)
    torch.testing.assert_close(adv[:, 1:].abs(), torch.full((4, 2), base, dtype=torch.float64))
    # ignored ids get no score
    adv = ktae(batch, KTAEConfig(ignore_token_ids=(5,))).advantages
    assert adv[0, 0].item() == pytest.approx(base)


def test_a_group_with_one_outcome_is_plain_grpo_and_padding_changes_nothing():
    batch = make_batch(8, 6, 4, seed=1)
    same = batch.replace(rewards=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]))
    a = CreditPipeline("ktae")(same).advantages
    g = CreditPipeline("grpo")(same).advantages
    torch.testing.assert_close(a[:4], g[:4])  # all correct: no key tokens
    assert not torch.allclose(a[4:], g[4:])
    padded = CreditPipeline("ktae")(pad_batch(same, 3)).advantages
    torch.testing.assert_close(padded[:, :6], a)


def test_float_token_ids_as_integration_layers_pass_them():
    batch = _random_batch(3)
    flt = batch.replace(token_ids=torch.where(batch.mask, batch.token_ids.double(), torch.full(batch.mask.shape, math.nan,
                                                                                              dtype=torch.float64)))
    assert torch.equal(ktae(flt, KTAEConfig()).advantages, ktae(batch, KTAEConfig()).advantages)


def test_bad_token_ids_and_config_are_one_line_errors():
    batch = _random_batch(0)
    with pytest.raises(CreditInputError, match=r"token_ids: expected integer token ids >= 0 .* got -1"):
        batch.replace(token_ids=torch.where(batch.mask, torch.full_like(batch.token_ids, -1), batch.token_ids))
    with pytest.raises(CreditInputError, match=r"token_ids: expected integer token ids >= 0 .* got 1.5"):
        batch.replace(token_ids=torch.full(batch.mask.shape, 1.5))
    with pytest.raises(CreditInputError, match=r"token_ids: expected shape"):
        batch.replace(token_ids=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(CreditInputError, match="token_ids: method 'ktae' needs this signal"):
        CreditPipeline("ktae")(batch.replace(token_ids=None))
    for kw, field in [({"alpha": -1.0}, "alpha"), ({"alpha": 0.0, "beta_ig": 0.0}, "alpha \\+ beta_ig"),
                      ({"top": 0.0}, "top"), ({"b": 2.0}, "b"), ({"k1": 0}, "k1"), ({"tf_term": 1}, "tf_term"),
                      ({"ignore_token_ids": (-3,)}, "ignore_token_ids"), ({"p_one_rule": "float64"}, "p_one_rule")]:
        with pytest.raises(ValueError, match=f"ktae {field}"):
            KTAEConfig(**kw)


def test_the_own_trainer_gives_ktae_the_rollouts_tokens(tmp_path):
    """One step of the own trainer with credit ktae: the credit batch carries the sampled tokens
    (no extra pass), and the credit is GRPO plus each token id's group score."""
    from tokencredit.train.config import LogConfig, OptimConfig, RolloutConfig, TaskConfig, TrainConfig
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(
        credit="ktae", steps=1, seed=0, output_dir=str(tmp_path / "run"),
        task=TaskConfig(name="add1", n_train=8, n_eval=2),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=4),
        optim=OptimConfig(micro_batch_size=8),
        log=LogConfig(eval_every=100, eval_at_start=False, progress=False),
    )
    cfg.model.name = "tiny"
    model, tok = tiny_model_and_tokenizer(seed=0)
    tr = Trainer(cfg, model=model, tokenizer=tok)
    tr.train_step()
    last = tr._last_batch
    cb = last["credit_batch"]
    assert torch.equal(cb.token_ids[cb.mask], last["batch"].response_ids[cb.mask])
    torch.testing.assert_close(last["credit"].advantages.double(), ref_advantages(cb), rtol=1e-5, atol=1e-5)


def test_verl_takes_ktae():
    """verl's trainer mode hands the tc_ktae estimator the step batch's responses as token_ids
    (run end to end on the driver in tests/test_verl_methods.py)."""
    pytest.importorskip("verl")
    from tokencredit.integrations.verl.core import DRIVER_SIGNALS, check_supported

    check_supported(CreditPipeline("ktae"))  # raised "estimator 'ktae' needs ['token_ids']" before
    assert "token_ids" in DRIVER_SIGNALS


def test_trls_trainer_gives_ktae_the_completion_tokens(tmp_path):
    """TokenCreditGRPOTrainer: the credit batch's token_ids are TRL's completion ids (floats after
    its gather, validated as integers) and the advantages are the core pipeline's."""
    pytest.importorskip("trl")
    import test_trl

    trainer = test_trl._make(tmp_path, "ktae", config={})
    trainer.train()
    assert trainer.records
    for rec in trainer.records:
        b = rec["batch"]
        assert torch.equal(b.token_ids[b.mask].long(), rec["out"]["completion_ids"][b.mask].long())
        torch.testing.assert_close(rec["out"]["advantages"].float(), CreditPipeline("ktae")(b, update_state=False).advantages.float())
