"""Methods round 3 (issue 32): SEPA's schedule in retrain's order, and the new losses and methods,
each against a transcription of its authors' code (read with the search tool, rewritten here
from the reading) and by properties that fail when the defining line is broken."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokencredit import CreditPipeline
from tokencredit.credit.methods.sepa import SEPAConfig, SEPAController

from helpers import make_batch


# -- SEPA: retrain's order ---------------------------------------------------------------------


class RetrainSEPA:
    """retrain's ``training/sepa.py`` linear schedule and gate, and its trainer's order
    (``training/trainer.py``: ``resolve_lambda(step=batch_idx)`` before the rollouts, then
    ``observe_correct_rate`` with the share of rewards ``> CORRECT_THRESHOLD`` (0.5,
    ``training/signals.py``) among the step's rewards)."""

    def __init__(self, steps, delay, gate):
        self.steps, self.delay, self.gate = steps, delay, gate
        self.open = gate <= 0.0

    def resolve_lambda(self, step):
        if self.steps <= 0:
            lin = 0.0
        else:
            shifted = step - self.delay
            lin = 0.0 if shifted <= 0.0 else min(shifted / self.steps, 1.0)
        return lin if self.open else 0.0

    def observe_correct_rate(self, rate):
        if self.open or self.gate <= 0.0:
            return
        if rate >= self.gate:
            self.open = True

    def run(self, rewards_per_step):
        lams = []
        for batch_idx, rewards in enumerate(rewards_per_step):
            lams.append(self.resolve_lambda(float(batch_idx)))
            correct = sum(1 for r in rewards if r > 0.5)
            self.observe_correct_rate(correct / len(rewards) if rewards else 0.0)
        return lams


def _sepa_lambdas(config, rewards_per_step):
    """The lambda each step's credit used in a pipeline that steps the controller (the trainers)."""
    pipe = CreditPipeline("sepa", sepa=config)
    base = make_batch(8, 5, 4, seed=0)
    out = []
    for rewards in rewards_per_step:
        out.append(pipe(base.replace(rewards=torch.tensor(rewards, dtype=torch.float32))).metrics["sepa/lambda"])
    return out


@pytest.mark.parametrize("setting", [
    dict(steps=500, delay_steps=50, correct_rate_gate=0.1),  # defaults (retrain's config/schema.py)
    dict(steps=4, delay_steps=1, correct_rate_gate=0.3),
    dict(steps=7, delay_steps=0, correct_rate_gate=0.0),
    dict(steps=3, delay_steps=5, correct_rate_gate=0.6),
])
@pytest.mark.parametrize("seed", range(3))
def test_sepa_lambda_equals_retrains_order_on_random_reward_streams(setting, seed):
    rng = random.Random(seed)
    n = 70 if setting["steps"] == 500 else 14
    # rewards in {0, 0.3, 0.6, 1}: 0.3 is not correct for retrain (r > 0.5), 0.6 is
    p_good = [0.0] * (n // 3) + [rng.choice([0.1, 0.3, 0.7]) for _ in range(n - n // 3)]
    stream = [[rng.choice([0.6, 1.0]) if rng.random() < p else rng.choice([0.0, 0.3]) for _ in range(8)] for p in p_good]
    want = RetrainSEPA(setting["steps"], setting["delay_steps"], setting["correct_rate_gate"]).run(stream)
    got = _sepa_lambdas(setting, stream)
    assert got == pytest.approx(want, abs=1e-12)
    assert any(v > 0 for v in want) or setting["steps"] == 500 and n < 51  # the schedule is exercised


def test_sepa_the_issues_cases():
    """Defaults, every response correct: step 50 has lambda (50 - 50) / 500 = 0 (the controller
    that stepped first had 0.002). Steps 4, delay 1, gate 0.3, the gate reached at step 3: step 3
    still has 0 (0.75 before), step 4 has 0.75. Rewards in {0, 0.3}: retrain's gate never opens."""
    ones = [[1.0] * 8] * 52
    assert _sepa_lambdas({}, ones)[50:] == pytest.approx([0.0, 0.002])
    late = [[0.0] * 8] * 3 + [[1.0] * 8] * 3
    assert _sepa_lambdas(dict(steps=4, delay_steps=1, correct_rate_gate=0.3), late) == pytest.approx(
        [0, 0, 0, 0, 0.75, 1.0])
    low = [[0.3, 0.0] * 4] * 8
    assert _sepa_lambdas(dict(steps=2, delay_steps=0, correct_rate_gate=0.1), low) == [0.0] * 8
    # the threshold is a parameter: at 0 the same stream opens the gate after step 0
    assert _sepa_lambdas(dict(steps=2, delay_steps=0, correct_rate_gate=0.1, correct_threshold=0.0), low)[1:3] == \
        pytest.approx([0.5, 1.0])


def test_sepa_state_round_trip_and_replay_use_the_steps_lambda():
    c = SEPAController(SEPAConfig(steps=4, delay_steps=0, correct_rate_gate=0.0))
    batch = make_batch(4, 3, 2, seed=0)
    for _ in range(3):
        c.update(batch)
    assert c.lam() == 0.5 and c.state_dict() == {"step": 3, "gate_open": True, "lam": 0.5}
    c2 = SEPAController(c.config)
    c2.load_state_dict(c.state_dict())
    assert c2.lam() == 0.5
    c2.update(batch)
    assert c2.lam() == 0.75
    # a state saved before "lam" was recorded replays as that controller computed (at its step)
    c3 = SEPAController(c.config)
    c3.load_state_dict({"step": 3, "gate_open": True})
    assert c3.lam() == 0.75
    with pytest.raises(ValueError, match="sepa state lam"):
        c3.load_state_dict({"step": 3, "gate_open": True, "lam": 1.5})
    with pytest.raises(ValueError, match="sepa correct_threshold"):
        SEPAConfig(correct_threshold=math.nan)


# -- GSPO (ppo with importance_sampling_level="sequence") and CISPO ------------------------------

from tokencredit.credit.losses import get_policy_loss  # noqa: E402


def _loss_inputs(seed, B=6, T=7, spread=0.3, uniform_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    lp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = torch.minimum(lp, torch.full_like(lp, -1e-3))
    if uniform_adv:
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    return lp, old, adv, mask


def _ours(name, lp, old, adv, mask, **cfg):
    x = lp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(x, old, adv, mask, cfg)
    (gx,) = torch.autograd.grad(loss, x)
    return loss.detach(), gx, metrics


def _theirs(fn, lp, *args):
    x = lp.clone().requires_grad_(True)
    loss = fn(x, *args)
    (gx,) = torch.autograd.grad(loss, x)
    return loss.detach(), gx


def verl_gspo(log_prob, old_log_prob, advantages, mask, clip_low, clip_high):
    """verl core_algos.compute_policy_loss_gspo, aggregated seq-mean-token-mean (its recommended mode)."""
    m = mask.to(log_prob.dtype)
    nak = log_prob - old_log_prob
    seq = (nak * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    pg = torch.maximum(-advantages * s, -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high))
    return ((pg * m).sum(-1) / m.sum(-1)).mean()


def trl_sequence_grpo(log_prob, old_log_prob, advantages, mask, eps_low, eps_high):
    """TRL GRPOTrainer._compute_loss, importance_sampling_level="sequence", loss_type="grpo"."""
    m = mask.to(log_prob.dtype)
    log_w = ((log_prob - old_log_prob) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_w.unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def verl_cispo(log_prob, old_log_prob, advantages, mask, clip_low, clip_high):
    """verl core_algos.compute_policy_loss_cispo, token-mean."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach() * advantages * log_prob
    m = mask.to(log_prob.dtype)
    return (pg * m).sum() / m.sum()


def trl_cispo(log_prob, old_log_prob, advantages, mask, eps_high, level="token"):
    """TRL GRPOTrainer._compute_loss, loss_type="cispo" (normalised by the batch's tokens)."""
    m = mask.to(log_prob.dtype)
    log_w = log_prob - old_log_prob
    if level == "sequence":
        log_w = ((log_w * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    clamped = torch.clamp(torch.exp(log_w), max=eps_high).detach()
    return (-clamped * advantages * log_prob * m).sum() / m.sum()


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])  # GSPO paper's; wide
@pytest.mark.parametrize("seed", range(4))
def test_gspo_equals_verls_on_random_token_advantages(seed, clip):
    lp, old, adv, mask = _loss_inputs(seed, spread=1e-3 if clip[0] < 1e-2 else 0.3)
    ours, g_ours, _ = _ours("ppo", lp, old, adv, mask, importance_sampling_level="sequence", clip_low=clip[0],
                            clip_high=clip[1], agg_mode="seq-mean-token-mean")
    ref, g_ref = _theirs(verl_gspo, lp, old, adv, mask, *clip)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, g_ours, 0.0), torch.where(mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)
    assert (g_ours[mask] != 0).any() and (g_ours[mask] == 0).any() or clip[0] > 0.1  # both branches


@pytest.mark.parametrize("seed", range(4))
def test_gspo_equals_trls_sequence_level_with_sequence_advantages(seed):
    lp, old, adv, mask = _loss_inputs(seed, spread=0.2, uniform_adv=True)
    ours, g_ours, _ = _ours("ppo", lp, old, adv, mask, importance_sampling_level="sequence", clip_low=0.1,
                            clip_high=0.12, agg_mode="seq-mean-token-mean")
    ref, g_ref = _theirs(trl_sequence_grpo, lp, old, adv, mask, 0.1, 0.12)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, g_ours, 0.0), torch.where(mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)


def test_gspo_ratio_is_the_sequences_and_clips_whole_sequences():
    """Every token of a row sees the row's geometric-mean ratio; a row whose ratio is outside the
    range (in the direction of its advantage) gets no gradient at all, a row inside gets s A_t on
    each token (per-token credit kept)."""
    T = 4
    mask = torch.ones(2, T, dtype=torch.bool)
    old = torch.full((2, T), -1.0, dtype=torch.float64)
    lp = old + torch.tensor([[0.4, -0.4, 0.02, -0.02], [0.3, 0.3, 0.3, 0.3]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -1.0, 0.5], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    _, g, m = _ours("ppo", lp, old, adv, mask, importance_sampling_level="sequence", clip_low=0.2, clip_high=0.2,
                    agg_mode="token-sum")
    # row 0: mean log-ratio 0, s = 1 (token ratios 1.49 / 0.67 would be clipped at token level)
    torch.testing.assert_close(g[0], -adv[0])
    # row 1: s = exp(0.3) > 1.2 with A > 0: clipped, the whole row's gradient is 0
    assert torch.equal(g[1], torch.zeros(T, dtype=torch.float64))
    assert m["ppo/ratio_max"] == pytest.approx(math.exp(0.3))
    _, g_tok, _ = _ours("ppo", lp, old, adv, mask, clip_low=0.2, clip_high=0.2, agg_mode="token-sum")
    assert not torch.allclose(g_tok[0], g[0])


@pytest.mark.parametrize("clip", [(0.2, 0.28), (0.5, 4.0), (0.0, 0.0)])
@pytest.mark.parametrize("seed", range(3))
def test_cispo_equals_verls(seed, clip):
    lp, old, adv, mask = _loss_inputs(seed, spread=0.8)
    ours, g_ours, _ = _ours("cispo", lp, old, adv, mask, epsilon_low=clip[0], epsilon_high=1 + clip[1])
    ref, g_ref = _theirs(verl_cispo, lp, old, adv, mask, *clip)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, g_ours, 0.0), torch.where(mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps_high", [5.0, 1.3])
@pytest.mark.parametrize("seed", range(3))
def test_cispo_equals_trls(seed, eps_high, level):
    lp, old, adv, mask = _loss_inputs(seed, spread=1.6)
    cfg = {} if eps_high == 5.0 else {"epsilon_high": eps_high}  # 5.0: the default
    ours, g_ours, m = _ours("cispo", lp, old, adv, mask, importance_sampling_level=level, **cfg)
    ref, g_ref = _theirs(trl_cispo, lp, old, adv, mask, eps_high, level)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, g_ours, 0.0), torch.where(mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)
    if level == "token":
        assert m["cispo/clip_frac_high"] > 0  # the cap is exercised


def test_cispo_keeps_a_truncated_gradient_where_ppo_has_none():
    """A token with ratio e^3 and A > 0: PPO's clipped token has gradient 0; CISPO's is
    -epsilon_high A (the weight truncated and held constant: d/dl of -sg(w) A l)."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.tensor([[-4.0, -1.0]], dtype=torch.float64)
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    _, g, m = _ours("cispo", lp, old, adv, mask, epsilon_high=5.0, agg_mode="token-sum")
    torch.testing.assert_close(g, torch.tensor([[-5.0 * 2.0, 1.0]], dtype=torch.float64))
    assert m["cispo/clip_frac_high"] == 0.5
    _, g_ppo, _ = _ours("ppo", lp, old, adv, mask, agg_mode="token-sum")
    assert float(g_ppo[0, 0]) == 0.0


def test_loss_options_are_one_line_errors():
    from tokencredit.credit.losses import CISPOLossConfig, PPOLossConfig

    with pytest.raises(ValueError, match="ppo importance_sampling_level: expected one of"):
        PPOLossConfig(importance_sampling_level="seq")
    with pytest.raises(ValueError, match="cispo epsilon_high: expected a number >= 1"):
        CISPOLossConfig(epsilon_high=0.2)
    with pytest.raises(ValueError, match="cispo epsilon_low"):
        CISPOLossConfig(epsilon_low=1.5)


# -- the losses in the trainers -------------------------------------------------------------------


@pytest.mark.parametrize("loss, acted", [
    (dict(policy_loss="cispo", epsilon_high=4.0), None),
    (dict(policy_loss="ppo", importance_sampling_level="sequence", clip_low=3e-4, clip_high=4e-4,
          agg_mode="seq-mean-token-mean"), None),
    (dict(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.0), "loss/clip_cov/cov_clip_frac"),
    (dict(policy_loss="kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=1.0), "loss/kl_cov/penalised_frac"),
])
def test_the_own_trainer_trains_with_gspo_cispo_and_the_cov_losses(tmp_path, loss, acted):
    """Composed with a calibrated credit spec (grpo+taco); the loss options reach the loss, the
    covariance losses act on some tokens (``acted``: the fraction they clipped or penalised)."""
    from test_trainer import _cfg, _metrics, _trainer
    from tokencredit.train.update import policy_loss_config

    cfg = _cfg(tmp_path, "grpo+taco", steps=1)
    for k, v in loss.items():
        setattr(cfg.loss, k, v)
    tr = _trainer(cfg)
    name = loss["policy_loss"]
    assert tr.policy_loss.name == name
    lc = policy_loss_config(tr.policy_loss, cfg.loss)
    assert {k: getattr(lc, k) for k in loss if k != "policy_loss"} == {k: v for k, v in loss.items() if k != "policy_loss"}
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert math.isfinite(m["loss"]) and f"loss/{name}/ratio_mean" in m
    if acted is not None:
        assert m[acted] > 0
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if p.requires_grad)


def test_a_loss_option_the_loss_lacks_is_a_one_line_error():
    from tokencredit.train.config import LossConfig
    from tokencredit.train.update import policy_loss_config

    with pytest.raises(ValueError, match="loss.importance_sampling_level: policy loss 'sapo' has no such setting"):
        policy_loss_config(get_policy_loss("sapo"), LossConfig(policy_loss="sapo", importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="loss.epsilon_high: policy loss 'ppo' has no such setting"):
        policy_loss_config(get_policy_loss("ppo"), LossConfig(epsilon_high=5.0))


@pytest.mark.parametrize("args", [dict(loss_type="cispo", epsilon_high=5.0), dict(importance_sampling_level="sequence")])
def test_trls_trainer_takes_trls_own_gspo_and_cispo_with_token_credit(tmp_path, args):
    """TokenCreditGRPOTrainer leaves the loss to TRL: its own importance_sampling_level="sequence"
    (GSPO) and loss_type="cispo" take the [B, T] credit."""
    pytest.importorskip("trl")
    import test_trl

    trainer = test_trl._make(tmp_path, "grpo+taco", **args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.records and all(r["out"]["advantages"].dim() == 2 for r in trainer.records)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("base,ours", [
    ("gspo", dict(name="ppo", importance_sampling_level="sequence", clip_low=0.2, clip_high=0.28,
                  agg_mode="seq-mean-token-mean")),
    ("cispo", dict(name="cispo", epsilon_low=0.2, epsilon_high=1.28, agg_mode="token-mean")),
])
def test_verls_own_gspo_and_cispo_take_the_calibrated_advantages(base, ours):
    """The verl plugin hands the calibrated advantages to verl's own loss (tokencredit.base_loss_mode):
    verl's gspo and cispo then equal tokencredit's on the same advantages."""
    pytest.importorskip("verl")
    from test_verl import actor_config, grpo_advantages, policy_tensors, rollout, tcv
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    tlr, mask, uid, _ = rollout()
    adv = grpo_advantages(tlr, mask, uid)
    logp, old = policy_tensors(mask)
    old = logp + (old - logp) * 0.3  # within GSPO's sequence clip for some rows
    agg = ours["agg_mode"]
    tcv.install_settings(tcv.settings_from_dict({"spec": "grpo+surprisal", "base_loss_mode": base}))
    try:
        x = logp.clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn("tokencredit")(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                                                    loss_agg_mode=agg, config=actor_config(), rollout_is_weights=None)
        (g,) = torch.autograd.grad(loss, x)
    finally:
        tcv.install_settings(None)
    from tokencredit import CreditBatch
    from tokencredit.credit.registry import get_method

    info = get_method("surprisal")
    cb = CreditBatch(response_mask=mask, rewards=torch.zeros(len(mask)), group_ids=torch.arange(len(mask)), logprobs=logp)
    cal = info.fn(cb, adv, info.make_config(None), None).advantages
    cfg = {k: v for k, v in ours.items() if k != "name"}
    want, g_want, _ = _ours(ours["name"], logp, old, cal, mask.bool(), **cfg)
    torch.testing.assert_close(loss.detach(), want.to(loss.dtype), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g * mask, g_want.to(g.dtype) * mask, rtol=1e-4, atol=1e-7)


# -- forking-token selection ---------------------------------------------------------------------


def authors_entropy_top_mask(entropy, response_mask, top_ratio=0.2):
    """Beyond-the-80-20-Rule-RLVR, verl/trainer/ppo/core_algos.py get_global_entropy_top_mask."""
    flat_e, flat_m = entropy.flatten(), response_mask.flatten().bool()
    resp = flat_e[flat_m]
    if resp.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.long)
    top_k = max(1, int(len(resp) * top_ratio + 0.9999))
    _, idx = torch.topk(resp, k=top_k)
    out = torch.zeros_like(flat_e, dtype=torch.long)
    out[flat_m.nonzero(as_tuple=False).squeeze(1)[idx]] = 1
    return out.view_as(entropy)


def authors_ppo_token_mean(log_prob, old_log_prob, advantages, loss_mask, clip_low=0.2, clip_high=0.28):
    """The authors' compute_policy_loss (their verl fork; no dual clip reached here), its loss mask
    response_mask * entropy_top_mask, token-mean."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    pg = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    m = loss_mask.to(log_prob.dtype)
    return (pg * m).sum() / m.sum()


def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL GRPOTrainer.get_high_entropy_mask on one process."""
    local = entropies[mask.bool()].float()
    thr = torch.quantile(local, threshold)
    return ((entropies * mask.float()) >= thr) & mask.bool()


def _forking_batch(seed, B=8, T=9):
    b = make_batch(B, T, 4, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(100 + seed)
    return b.replace(entropy=torch.rand(B, T, generator=g, dtype=torch.float64) * 2)


@pytest.mark.parametrize("rho", [0.2, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_forking_equals_the_authors_loss(seed, rho):
    """grpo+forking advantages in a token-mean PPO loss over every valid token = the authors' PPO
    loss on GRPO's advantages averaged over their entropy-top tokens only (value and gradient)."""
    b = _forking_batch(seed)
    pipe = CreditPipeline("grpo+forking", forking={"rho": rho})
    out = pipe(b)
    grpo = CreditPipeline("grpo")(b).advantages
    top = authors_entropy_top_mask(b.entropy, b.mask, rho)
    assert torch.equal(out.token_weights > 0, top.bool())
    g = torch.Generator().manual_seed(seed)
    old = b.logprobs
    lp = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    ours, g_ours, _ = _ours("ppo", lp, old, out.advantages, b.mask, clip_low=0.2, clip_high=0.28, agg_mode="token-mean")
    ref, g_ref = _theirs(authors_ppo_token_mean, lp, old, grpo, b.mask.long() * top)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(b.mask, g_ours, 0.0), torch.where(b.mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rho", [0.2, 0.37])
@pytest.mark.parametrize("seed", range(3))
def test_forking_quantile_equals_trls_top_entropy_quantile(seed, rho):
    """selection="quantile", renormalize=False: TRL's entropy mask times the per-token loss."""
    b = _forking_batch(seed)
    out = CreditPipeline("grpo+forking", forking={"rho": rho, "selection": "quantile", "renormalize": False})(b)
    grpo = CreditPipeline("grpo")(b).advantages
    trl = trl_high_entropy_mask(b.entropy, b.mask, 1 - rho)
    torch.testing.assert_close(out.advantages, torch.where(trl, grpo, torch.zeros_like(grpo)), rtol=0, atol=0)


def test_forking_keeps_exactly_the_top_share_and_nothing_else():
    b = _forking_batch(0)
    out = CreditPipeline("grpo+forking")(b)
    keep = out.token_weights > 0
    n = int(b.mask.sum())
    k = math.ceil(0.2 * n)
    assert int(keep.sum()) == k and out.metrics["forking/scale"] == pytest.approx(n / k)
    h = b.entropy[b.mask]
    assert float(b.entropy[keep].min()) > float(h.sort(descending=True).values[k])  # the k largest
    grpo = CreditPipeline("grpo")(b).advantages
    torch.testing.assert_close(out.advantages[keep], grpo[keep] * n / k)
    assert torch.equal(out.advantages[~keep], torch.zeros(int((~keep).sum()), dtype=out.advantages.dtype))
    with pytest.raises(ValueError, match="forking rho: expected a number in \\(0, 1\\]"):
        CreditPipeline("grpo+forking", forking={"rho": 0.0})
    with pytest.raises(ValueError, match="forking selection"):
        CreditPipeline("grpo+forking", forking={"selection": "top"})


def test_the_own_trainer_trains_with_forking(tmp_path):
    from test_trainer import _cfg, _metrics, _trainer

    tr = _trainer(_cfg(tmp_path, "grpo+forking", steps=1))
    tr.train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    kept = [v for k, v in m.items() if k.endswith("forking/kept_frac")]
    assert len(kept) == 1 and 0.2 <= kept[0] < 0.3  # ceil(0.2 N) of a few dozen tokens
    cb, out = tr._last_batch["credit_batch"], tr._last_batch["credit"]
    keep = forking_mask_of(cb)
    assert torch.equal(out.advantages[cb.mask & ~keep], torch.zeros(int((cb.mask & ~keep).sum()), dtype=out.advantages.dtype))


def forking_mask_of(cb):
    from tokencredit.credit.methods.forking import forking_mask

    return forking_mask(cb.entropy, cb.mask, 0.2)


def test_trls_trainer_and_verl_take_forking(tmp_path):
    """TokenCreditGRPOTrainer: the credit of each generation batch is grpo+forking on its entropy;
    verl's plugin accepts it (the calibrator runs in its loss, on each micro-batch, as the authors')."""
    pytest.importorskip("trl")
    import test_trl

    trainer = test_trl._make(tmp_path, "grpo+forking", config={})
    trainer.train()
    assert trainer.records
    for rec in trainer.records:
        b = rec["batch"]
        want = CreditPipeline("grpo+forking")(b, update_state=False).advantages
        torch.testing.assert_close(rec["out"]["advantages"].float(), want.float())
        assert int((want[b.mask] != 0).sum()) <= max(1, math.ceil(0.2 * int(b.mask.sum())))
    pytest.importorskip("verl")
    from tokencredit.integrations.verl.core import check_supported

    check_supported(CreditPipeline("grpo+forking"))
