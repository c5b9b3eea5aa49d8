"""OTB (verl's optimal token baseline): against a transcription of verl's computation, its
defining property, its signal (sum_pi_squared) and where the trainers give it or refuse it."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import tokencredit as tc
from tokencredit import CreditBatch, CreditInputError, CreditPipeline
from tokencredit.credit.methods.otb import OTBConfig, otb
from tokencredit.credit.plan import plan_signals
from tokencredit.engine.signals import token_signals

from helpers import make_batch


# ---- the reference: verl's computation, transcribed -------------------------------------
#
# volcengine/verl, verl/trainer/ppo/core_algos.py, compute_optimal_token_baseline_advantage
# (epsilon 1e-8, handle_zero_tail False, rollout_is_weights None), fed as verl's ray_trainer
# feeds it: the outcome score at each response's last valid token, the actor's old log-probs and
# sum_pi_squared; verl/utils/torch_functional.py calculate_sum_pi_squared_from_logits.

def verl_sum_pi_squared(logits):
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def verl_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, handle_zero_tail=False, epsilon=1e-8):
    bs = token_level_rewards.shape[0]
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    w_cum = (w * response_mask).cumsum(dim=-1)
    groups = defaultdict(list)
    for i in range(bs):
        groups[index[i]].append(i)
    base = torch.zeros_like(returns)
    for members in groups.values():
        if len(members) == 1:
            continue
        idx = torch.tensor(members)
        G, W, M = returns[idx], w_cum[idx], response_mask[idx]
        b = (G * W * M).sum(dim=0) / ((W * M).sum(dim=0) + epsilon)
        base[idx] = b.unsqueeze(0).expand(len(members), -1)
        if handle_zero_tail:
            lengths = M.sum(dim=-1)
            srt, _ = torch.sort(lengths)
            longest, second = int(srt[-1]), int(srt[-2])
            at = (lengths == longest).nonzero(as_tuple=True)[0]
            if at.numel() == 1 and longest > second:
                base[members[int(at[0])], second:] = 0.0
    return (returns - base) * response_mask


def random_case(seed, group_sizes=(4, 4, 2, 3), T=9, V=13, temperature=1.0, lengths=None):
    """Logits of a random policy, tokens sampled from it, outcome rewards, right-padded lengths."""
    g = torch.Generator().manual_seed(seed)
    B = sum(group_sizes)
    logits = torch.randn(B, T, V, generator=g) * 2.5
    probs = torch.softmax(logits / temperature, -1)
    tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(B, T)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)).float()
    rewards = torch.randint(0, 2, (B,), generator=g).float() * torch.rand(B, generator=g).add(0.5)
    index = [f"uid{k}" for k, n in enumerate(group_sizes) for _ in range(n)]
    group_ids = torch.tensor([k * 5 + 2 for k, n in enumerate(group_sizes) for _ in range(n)])
    return logits, tokens, mask, rewards, index, group_ids


def both(seed, config=None, temperature=1.0, **kw):
    logits, tokens, mask, rewards, index, group_ids = random_case(seed, temperature=temperature, **kw)
    sig = token_signals(logits, tokens, temperature=temperature, want=("logprobs", "sum_pi_squared"))
    # verl's inputs: zeros at padding, the score at the last valid token; the same signals as
    # ours (sum_pi_squared against verl's own formula: test_sum_pi_squared_equals_verls_formula)
    lp = sig["logprobs"] * mask
    sq = sig["sum_pi_squared"] * mask
    last = (mask.sum(1).long() - 1).clamp_min(0)
    tlr = torch.zeros_like(mask).scatter_(1, last.unsqueeze(1), rewards.unsqueeze(1)) * mask
    cfg = config or OTBConfig()
    ref = verl_otb(tlr, mask, index, lp, sq, handle_zero_tail=cfg.handle_zero_tail, epsilon=cfg.eps)
    # ours: NaN at padding (never read), the signals as the policy pass gives them
    nan = torch.full_like(mask, float("nan"))
    batch = CreditBatch(response_mask=mask, rewards=rewards, group_ids=group_ids,
                        logprobs=torch.where(mask.bool(), sig["logprobs"], nan),
                        sum_pi_squared=torch.where(mask.bool(), sig["sum_pi_squared"], nan))
    return otb(batch, cfg).advantages, ref, batch


@pytest.mark.parametrize("seed", range(6))
def test_equals_verls_computation_at_defaults(seed):
    ours, ref, _ = both(seed)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert ours.abs().max() > 0.05  # not a comparison between zeros


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("config", [OTBConfig(eps=0.5), OTBConfig(handle_zero_tail=True), OTBConfig(eps=1e-3, handle_zero_tail=True)],
                         ids=["eps", "zero_tail", "both"])
def test_equals_verls_computation_off_defaults(seed, config):
    ours, ref, _ = both(seed, config, temperature=0.7)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    if config.eps != OTBConfig().eps:  # eps acts on these inputs (zero_tail: test_zero_tail_cases_against_verl)
        default, _, _ = both(seed, temperature=0.7)
        assert not torch.allclose(ours, default, atol=1e-4)


def test_zero_tail_cases_against_verl():
    """A unique longest response (zeroed beyond the second-longest length), a tie for longest
    (untouched)."""
    cfg = OTBConfig(handle_zero_tail=True)
    lengths = [3, 9, 5, 2,  7, 7, 1, 4,  6, 3,  2, 8, 8]
    ours, ref, batch = both(11, cfg, lengths=lengths)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # row 1 (unique longest of group 0) is its return beyond the second-longest length 5
    assert torch.equal(ours[1, 5:9], batch.rewards[1].expand(4))
    default, _, _ = both(11, lengths=lengths)
    assert torch.equal(ours[4:8], default[4:8]) and torch.equal(ours[10:], default[10:])  # ties for longest: as without


def test_a_group_of_one_is_refused_in_one_line():
    """verl gives a lone response A = G; here, as for every group-relative method, an error."""
    batch = make_batch(4, 3, 2)
    with pytest.raises(CreditInputError, match=r"^group_ids: method 'otb' needs groups of at least 2 responses, got group 1 with 1$"):
        otb(batch.replace(group_ids=torch.tensor([0, 0, 0, 1])), OTBConfig())


def test_sum_pi_squared_equals_verls_formula():
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(3)) * 3
    tokens = torch.zeros(3, 5, dtype=torch.long)
    for tau in (1.0, 0.6):
        got = token_signals(logits, tokens, temperature=tau, want=("sum_pi_squared",), chunk_size=4)["sum_pi_squared"]
        torch.testing.assert_close(got, verl_sum_pi_squared(logits / tau), rtol=1e-5, atol=1e-7)


# ---- the defining property ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_baseline_is_the_energy_weighted_mean_return(seed):
    """B_t is the W-weighted mean of the group's returns, with W_t = sum_{j <= t} (1 - 2 pi_j +
    sum pi^2) computed here from the signals: at every position the W-weighted advantages of a
    group sum to eps * B_t (0 but for eps). Fails when the per-token energy w_t, its cumulative
    sum or the weighting changes."""
    batch = make_batch(12, 7, 4, seed=seed, binary_rewards=False)
    cfg = OTBConfig(eps=1e-8)
    adv = otb(batch, cfg).advantages.double()
    m = batch.mask
    w = torch.where(m, 1 - 2 * batch.logprobs.double().exp() + batch.sum_pi_squared.double(), torch.zeros((), dtype=torch.float64))
    W = w.cumsum(1)
    R = batch.rewards.double().unsqueeze(1)
    for gid in batch.group_ids.unique():
        rows = batch.group_ids == gid
        Wg, Ag, mg = W[rows], adv[rows], m[rows]
        weighted = (Wg * Ag * mg).sum(0)
        assert weighted.abs().max() < 1e-5, weighted
        # and not trivially: the baseline moves with W, unlike the group's plain mean return
        base = (R[rows] - Ag)[mg]
        assert base.max() - base.min() > 1e-3


def test_equal_energies_give_the_group_mean_return():
    """Every response of a group with the same per-token energy and length: B_t = mean R."""
    B, T = 4, 5
    mask = torch.ones(B, T)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    lp = torch.full((B, T), -0.7)
    sq = torch.full((B, T), 0.3)
    batch = CreditBatch(response_mask=mask, rewards=rewards, group_ids=torch.zeros(B, dtype=torch.long), logprobs=lp, sum_pi_squared=sq)
    adv = otb(batch, OTBConfig()).advantages
    torch.testing.assert_close(adv, (rewards - rewards.mean()).unsqueeze(1).expand(B, T), rtol=0, atol=1e-6)


def test_a_certain_policy_has_no_energy_and_no_baseline():
    """pi_t = 1 on a one-hot distribution: w = 1 - 2 + 1 = 0, W = 0, B = 0 / eps = 0, A = R."""
    B, T = 4, 3
    batch = CreditBatch(response_mask=torch.ones(B, T), rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                        group_ids=torch.zeros(B, dtype=torch.long), logprobs=torch.zeros(B, T), sum_pi_squared=torch.ones(B, T))
    torch.testing.assert_close(otb(batch, OTBConfig()).advantages, batch.rewards.unsqueeze(1).expand(B, T))


# ---- bad input: one line naming the field ----------------------------------------------


@pytest.mark.parametrize("kw,match", [
    ({"eps": 0.0}, r"^otb eps: expected a finite number > 0, got 0.0$"),
    ({"eps": float("nan")}, r"^otb eps: expected a finite number > 0, got nan$"),
    ({"eps": "1e-8"}, r"^otb eps: expected a finite number > 0, got '1e-8'$"),
    ({"eps": True}, r"^otb eps: expected a finite number > 0, got True$"),
    ({"handle_zero_tail": "yes"}, r"^otb handle_zero_tail: expected a bool, got 'yes'$"),
])
def test_bad_config_is_one_line(kw, match):
    with pytest.raises(ValueError, match=match):
        OTBConfig(**kw)
    with pytest.raises(ValueError, match=match):
        CreditPipeline("otb", {"otb": kw})


def test_bad_config_from_the_command_line_is_one_line(tmp_path):
    """As test_reliability's _cli: main's exit code (or SystemExit's) and its stderr."""
    import contextlib
    import io

    from tokencredit.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--credit", "otb", "--credit-args", "otb.eps=-1", "--steps", "1",
                         "--output-dir", str(tmp_path / "run")])
        except SystemExit as e:
            code = e.code
    msg = err.getvalue().strip()
    assert code not in (0, None) and not (tmp_path / "run").exists()
    assert len(msg.splitlines()) == 1 and "otb.eps: expected a finite number > 0, got -1" in msg, msg


def test_missing_signal_and_bad_signal_name_the_field():
    batch = make_batch(8, 5, 4, seed=1)
    with pytest.raises(CreditInputError, match="sum_pi_squared: method 'otb' needs this signal"):
        CreditPipeline("otb")(batch.replace(sum_pi_squared=None))
    bad = batch.sum_pi_squared.clone()
    bad[0, 0] = 1.5
    with pytest.raises(CreditInputError, match=r"sum_pi_squared: expected a probability in \[0, 1\], got 1.5 at \(0, 0\)"):
        batch.replace(sum_pi_squared=bad)


# ---- declarations, and the trainers --------------------------------------------------------


def test_registered_with_its_declarations():
    info = tc.get_method("otb")
    assert info.kind == "estimator" and info.provenance == "ref-code" and info.needs_groups
    assert info.requires == {"logprobs", "sum_pi_squared"}
    assert "otb" in tc.list_methods("estimator")
    plan = plan_signals(CreditPipeline("otb"), lora=False)
    assert plan.passes == ("policy",) and set(plan.policy) == {"logprobs", "sum_pi_squared"}


def test_listed_by_the_cli(capsys):
    from tokencredit.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "otb" in out and "sum_pi_squared" in out


def test_the_own_trainer_gives_otb_the_policy_pass(tmp_path):
    """One step of the own trainer: sum_pi_squared and the log-probs are the policy's (a forward
    of the same weights, here recomputed) and the credit is OTB's on that batch."""
    from tokencredit.train.config import LogConfig, OptimConfig, RolloutConfig, TaskConfig, TrainConfig
    from tokencredit.engine.forward import forward_response
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(
        credit="otb", steps=1, seed=0, output_dir=str(tmp_path / "run"),
        task=TaskConfig(name="add1", n_train=8, n_eval=2),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=4),
        optim=OptimConfig(micro_batch_size=8),
        log=LogConfig(eval_every=100, eval_at_start=False, progress=False),
    )
    cfg.model.name = "tiny"
    model, tok = tiny_model_and_tokenizer(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tr = Trainer(cfg, model=model, tokenizer=tok)
    tr.train_step()
    last = tr._last_batch
    cb, sb = last["credit_batch"], last["batch"]
    m = cb.mask
    fresh, _ = tiny_model_and_tokenizer(seed=0)
    fresh.load_state_dict(before)
    fresh.eval()
    with torch.no_grad():
        _, logits = forward_response(fresh, sb.input_ids, sb.attention_mask, sb.prompt_len)
    logp = torch.log_softmax(logits.double() / tr._temperature(), -1)
    torch.testing.assert_close(cb.sum_pi_squared.double()[m], logp.exp().square().sum(-1)[m], rtol=1e-4, atol=1e-6)
    own = logp.gather(-1, sb.response_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(cb.logprobs.double()[m], own[m], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last["credit"].advantages, otb(cb, OTBConfig()).advantages)


def test_verl_refuses_otb_in_one_line():
    """verl's trainer mode hands a driver-side estimator only DRIVER_SIGNALS; sum_pi_squared is
    not among them (verl's own actor computes it with calculate_sum_pi_squared for its own
    estimator), so the plugin refuses the spec before any worker starts."""
    pytest.importorskip("verl")
    from tokencredit.integrations.verl.core import DRIVER_SIGNALS, check_supported

    assert "sum_pi_squared" not in DRIVER_SIGNALS
    with pytest.raises(ValueError) as e:
        check_supported(CreditPipeline("otb"))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "estimator 'otb' needs ['sum_pi_squared']" in msg and "the trainer mode gives a verl estimator only" in msg


def test_trls_trainer_gives_otb_its_policy_pass(tmp_path):
    """TokenCreditGRPOTrainer: the plan's policy pass computes sum_pi_squared from the completion
    logits (passes.run_passes) and the advantages handed to TRL are the core pipeline's."""
    pytest.importorskip("trl")
    import test_trl

    trainer = test_trl._make(tmp_path, "otb", config={})
    trainer.train()
    assert trainer.records
    for rec in trainer.records:
        b = rec["batch"]
        assert b.sum_pi_squared is not None and b.logprobs is not None
        sq = b.sum_pi_squared[b.mask]
        assert ((sq > 0) & (sq <= 1)).all()
        torch.testing.assert_close(rec["out"]["advantages"].float(), CreditPipeline("otb")(b, update_state=False).advantages.float())
