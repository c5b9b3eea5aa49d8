"""Methods round 3, second part (issue 32): the covariance losses Clip-Cov and KL-Cov, each
against a transcription of verl's functions (``core_algos.py`` ``compute_policy_loss_clip_cov`` /
``compute_policy_loss_kl_cov``, read with the search tool and rewritten here from the reading)
on random inputs, at verl's defaults and off them, and by properties that fail when the defining
line is broken."""

from __future__ import annotations

import math

import pytest
import torch

from tokencredit.credit.losses import ClipCovLossConfig, KLCovLossConfig, get_policy_loss


def _inputs(seed, B=8, T=40, spread=0.3, adv_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.05
    lp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = torch.minimum(lp, torch.full_like(lp, -1e-3))
    adv = adv_scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    return lp, old, adv, mask


def _ours(name, lp, old, adv, mask, seed=None, **cfg):
    x = lp.clone().requires_grad_(True)
    if seed is not None:
        torch.manual_seed(seed)
    loss, metrics = get_policy_loss(name)(x, old, adv, mask, cfg)
    (gx,) = torch.autograd.grad(loss, x)
    return loss.detach(), gx, metrics


def _theirs(fn, lp, *args, seed=None, **kw):
    x = lp.clone().requires_grad_(True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = fn(x, *args, **kw)
    (gx,) = torch.autograd.grad(loss, x)
    return loss.detach(), gx


def _masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def verl_clip_cov(log_prob, old_log_prob, advantages, response_mask, clip_low=0.2, clip_high=0.2,
                  clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0):
    """verl compute_policy_loss_clip_cov (0.9.1), token-mean, no rollout IS weights: the PPO
    surrogate; covariance of the advantage and the log-prob (centred by their masked means) set
    to -inf on padding and on tokens PPO's clip holds; max(int(ratio N), 1) tokens drawn by
    randperm among those strictly inside (lb, ub) get a factor 0."""
    m = response_mask.to(log_prob.dtype)
    ratio = torch.exp(log_prob - old_log_prob)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    by_clip = (pg2 > pg1) & (response_mask > 0)
    cov = (advantages - _masked_mean(advantages, m)) * (log_prob - _masked_mean(log_prob.detach(), m))
    cov = cov.detach().clone()
    cov[response_mask == 0] = -torch.inf
    cov[by_clip] = -torch.inf
    n_clip = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    cand = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & (response_mask > 0))
    corr = torch.ones_like(advantages)
    if len(cand) > 0:
        cand = cand[torch.randperm(len(cand))[: min(n_clip, len(cand))]]
        corr[cand[:, 0], cand[:, 1]] = 0
    pg = torch.maximum(pg1, pg2) * corr
    return (pg * m).sum() / m.sum()


def verl_kl_cov(log_prob, old_log_prob, advantages, response_mask, kl_cov_ratio=0.0002, ppo_kl_coef=0.1):
    """verl compute_policy_loss_kl_cov (0.9.1), token-mean: the unclipped surrogate, and on the
    max(1, int(N ratio)) valid tokens of largest covariance (plain means over the valid tokens)
    the surrogate plus ppo_kl_coef |log ratio|."""
    nak = log_prob - old_log_prob
    ratio = torch.exp(nak)
    pg = -advantages * ratio
    pg_kl = -advantages * ratio + ppo_kl_coef * nak.abs()
    valid = response_mask > 0
    flat_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a = advantages[valid].detach().reshape(-1)
    lp = log_prob[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * kl_cov_ratio))
    top = flat_idx[torch.topk(cov, k, largest=True).indices]
    T = advantages.shape[1]
    pg = pg.clone()
    pg[top // T, top % T] = pg_kl[top // T, top % T]
    m = response_mask.to(log_prob.dtype)
    return (pg * m).sum() / m.sum()


CLIP_COV_SETTINGS = [
    {},  # verl's defaults: one token of a few hundred, band (1, 5)
    dict(clip_cov_ratio=0.05, clip_cov_lb=0.2, clip_cov_ub=3.0, clip_low=0.1, clip_high=0.3),
    dict(clip_cov_ratio=0.5, clip_cov_lb=-1.0, clip_cov_ub=2.0),  # more candidates than the band holds
]


@pytest.mark.parametrize("setting", CLIP_COV_SETTINGS, ids=["defaults", "off1", "off2"])
@pytest.mark.parametrize("seed", range(4))
def test_clip_cov_equals_verls_on_random_inputs(seed, setting):
    lp, old, adv, mask = _inputs(seed)
    ours, g_ours, m = _ours("clip_cov", lp, old, adv, mask, seed=1000 + seed, **setting)
    ref, g_ref = _theirs(verl_clip_cov, lp, old, adv, mask, seed=1000 + seed, **setting)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, g_ours, 0.0), torch.where(mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)
    cfg = ClipCovLossConfig(**setting)
    n = int(mask.sum())
    assert m["clip_cov/band_frac"] > 0  # the band holds candidates: the cut is exercised
    assert round(m["clip_cov/cov_clip_frac"] * n) == min(max(int(cfg.clip_cov_ratio * n), 1), round(m["clip_cov/band_frac"] * n))


@pytest.mark.parametrize("setting", [{}, dict(kl_cov_ratio=0.05, ppo_kl_coef=1.0), dict(kl_cov_ratio=1.0, ppo_kl_coef=0.3)],
                         ids=["defaults", "authors_coef", "all"])
@pytest.mark.parametrize("seed", range(4))
def test_kl_cov_equals_verls_on_random_inputs(seed, setting):
    lp, old, adv, mask = _inputs(seed)
    ours, g_ours, m = _ours("kl_cov", lp, old, adv, mask, **setting)
    ref, g_ref = _theirs(verl_kl_cov, lp, old, adv, mask, **setting)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.where(mask, g_ours, 0.0), torch.where(mask, g_ref, 0.0), rtol=1e-10, atol=1e-12)
    n = int(mask.sum())
    assert round(m["kl_cov/penalised_frac"] * n) == max(1, int(n * KLCovLossConfig(**setting).kl_cov_ratio))


def test_clip_cov_cuts_exactly_the_drawn_band_tokens_and_leaves_ppo_elsewhere():
    """The tokens whose gradient is 0 and is not PPO's 0 are inside the covariance band, not held by
    the clip, as many as the ratio asks; every other token has PPO's gradient."""
    lp, old, adv, mask = _inputs(7)
    cfg = dict(clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=4.0, clip_low=0.2, clip_high=0.2)
    _, g, m = _ours("clip_cov", lp, old, adv, mask, seed=3, agg_mode="token-sum", **cfg)
    _, g_ppo, _ = _ours("ppo", lp, old, adv, mask, agg_mode="token-sum", clip_low=0.2, clip_high=0.2)
    differs = mask & (g != g_ppo)
    ratio = (lp - old).exp()
    held = (-adv * ratio.clamp(0.8, 1.2)) > (-adv * ratio)
    cov = (adv - adv[mask].mean()) * (lp - lp[mask].mean())
    n = int(mask.sum())
    assert int(differs.sum()) == max(int(0.05 * n), 1) > 1
    assert torch.equal(g[differs], torch.zeros(int(differs.sum()), dtype=g.dtype))
    assert not held[differs].any()
    assert bool(((cov[differs] > 0.5) & (cov[differs] < 4.0)).all())
    torch.testing.assert_close(g[mask & ~differs], g_ppo[mask & ~differs], rtol=0, atol=0)
    # the draw is random: another seed cuts other tokens, as many
    _, g2, _ = _ours("clip_cov", lp, old, adv, mask, seed=4, agg_mode="token-sum", **cfg)
    differs2 = mask & (g2 != g_ppo)
    assert int(differs2.sum()) == int(differs.sum()) and not torch.equal(differs, differs2)


def test_kl_cov_penalises_exactly_the_top_covariance_tokens():
    """The top-k tokens by covariance get -A r + coef sign(l - l_old) as gradient, every other
    token the unclipped surrogate's -A r (no clip anywhere)."""
    lp, old, adv, mask = _inputs(5, spread=0.8)
    coef = 0.7
    _, g, _ = _ours("kl_cov", lp, old, adv, mask, kl_cov_ratio=0.1, ppo_kl_coef=coef, agg_mode="token-sum")
    ratio = (lp - old).exp()
    cov = (adv - adv[mask].mean()) * (lp - lp[mask].mean())
    n = int(mask.sum())
    k = int(0.1 * n)
    thr = cov[mask].sort(descending=True).values[k - 1]
    top = mask & (cov >= thr)
    assert int(top.sum()) == k
    want = torch.where(top, -adv * ratio + coef * torch.sign(lp - old), -adv * ratio)
    torch.testing.assert_close(torch.where(mask, g, 0.0), torch.where(mask, want, 0.0), rtol=1e-12, atol=1e-12)
    assert (ratio[mask] > 1.5).any()  # far outside any clip range, still the full gradient


def test_cov_losses_take_token_weights_and_any_credit():
    """loss_weights multiply the per-token loss (as verl's rollout IS weights); a calibrated credit's
    zeros (forking-like) reach the covariance."""
    lp, old, adv, mask = _inputs(2)
    w = torch.rand(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for name, cfg in (("clip_cov", dict(clip_cov_ratio=0.05, clip_cov_lb=0.2)), ("kl_cov", dict(kl_cov_ratio=0.05))):
        info = get_policy_loss(name)
        torch.manual_seed(0)
        x = lp.clone().requires_grad_(True)
        lw, _ = info(x, old, adv, mask, dict(agg_mode="token-sum", **cfg), loss_weights=w)
        (gw,) = torch.autograd.grad(lw, x)
        torch.manual_seed(0)
        _, g, _ = _ours(name, lp, old, adv, mask, agg_mode="token-sum", **cfg)
        torch.testing.assert_close(torch.where(mask, gw, 0.0), torch.where(mask, g * w, 0.0))


def test_cov_loss_options_are_one_line_errors():
    with pytest.raises(ValueError, match=r"clip_cov clip_cov_ratio: expected a number in \(0, 1\], got 0"):
        ClipCovLossConfig(clip_cov_ratio=0)
    with pytest.raises(ValueError, match=r"clip_cov clip_cov_ub: expected a number > clip_cov_lb \(1.0\), got 0.5"):
        ClipCovLossConfig(clip_cov_ub=0.5)
    with pytest.raises(ValueError, match="kl_cov ppo_kl_coef: expected a number >= 0"):
        KLCovLossConfig(ppo_kl_coef=-1.0)
    with pytest.raises(ValueError, match=r"kl_cov kl_cov_ratio: expected a number in \(0, 1\]"):
        KLCovLossConfig(kl_cov_ratio=math.nan)


def test_a_cov_option_the_loss_lacks_is_a_one_line_error():
    from tokencredit.train.config import LossConfig
    from tokencredit.train.update import policy_loss_config

    with pytest.raises(ValueError, match="loss.clip_cov_ratio: policy loss 'ppo' has no such setting"):
        policy_loss_config(get_policy_loss("ppo"), LossConfig(clip_cov_ratio=0.01))
    with pytest.raises(ValueError, match="loss.ppo_kl_coef: policy loss 'clip_cov' has no such setting"):
        policy_loss_config(get_policy_loss("clip_cov"), LossConfig(policy_loss="clip_cov", ppo_kl_coef=1.0))


def test_trls_trainer_refuses_clip_cov_and_kl_cov_in_one_line(tmp_path):
    """TRL's GRPOConfig takes any loss_type string and fails only at the first loss; the subclass
    refuses the two TRL lacks before the model is touched."""
    pytest.importorskip("trl")
    import test_trl

    for name in ("clip_cov", "kl_cov"):
        with pytest.raises(ValueError, match=f"loss_type='{name}': TRL's GRPOTrainer has no .* loss") as e:
            test_trl._make(tmp_path, "grpo", loss_type=name)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("base,cfg", [
    ("clip_cov", dict(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=5.0)),
    ("kl_cov", dict(kl_cov_ratio=0.05, ppo_kl_coef=0.5)),
])
def test_verls_own_clip_cov_and_kl_cov_take_the_calibrated_advantages(base, cfg):
    """verl has both losses (loss_mode clip_cov / kl_cov): the plugin hands the calibrated
    advantages to verl's own (tokencredit.base_loss_mode=<same name>), which then equals
    tokencredit's loss of that name on the same advantages (clip_cov: the same draw)."""
    pytest.importorskip("verl")
    from test_verl import actor_config, grpo_advantages, policy_tensors, rollout, tcv
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    tlr, mask, uid, _ = rollout()
    adv = grpo_advantages(tlr, mask, uid)
    logp, old = policy_tensors(mask)
    low, high = (actor_config().clip_ratio_low, actor_config().clip_ratio_high)
    tcv.install_settings(tcv.settings_from_dict({"spec": "grpo+surprisal", "base_loss_mode": base}))
    try:
        x = logp.clone().requires_grad_(True)
        torch.manual_seed(11)
        conf = actor_config(policy_loss={"_target_": "verl.workers.config.PolicyLossConfig", "loss_mode": "tokencredit", **cfg})
        loss, _ = get_policy_loss_fn("tokencredit")(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                                                    loss_agg_mode="token-mean", config=conf, rollout_is_weights=None)
        (g,) = torch.autograd.grad(loss, x)
    finally:
        tcv.install_settings(None)
    from tokencredit import CreditBatch
    from tokencredit.credit.registry import get_method

    info = get_method("surprisal")
    cb = CreditBatch(response_mask=mask, rewards=torch.zeros(len(mask)), group_ids=torch.arange(len(mask)), logprobs=logp)
    cal = info.fn(cb, adv, info.make_config(None), None).advantages
    ours_cfg = dict(cfg, clip_low=low, clip_high=high) if base == "clip_cov" else cfg
    want, g_want, m = _ours(base, logp, old, cal, mask.bool(), seed=11, **ours_cfg)
    acted = m["clip_cov/cov_clip_frac"] if base == "clip_cov" else m["kl_cov/penalised_frac"]
    assert acted > 0
    torch.testing.assert_close(loss.detach(), want.to(loss.dtype), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g * mask, g_want.to(g.dtype) * mask, rtol=1e-4, atol=1e-7)


# -- rollout correction (verl's rollout_correction: TIS and MIS against the behaviour log-probs) ---------

from tokencredit.credit.losses.rollout_correction import RolloutCorrectionConfig, rollout_correction  # noqa: E402


def _mismatch(seed, B=10, T=30, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    behaviour = -torch.rand(B, T, generator=g, dtype=torch.float32) * 4
    old = behaviour + spread * torch.randn(B, T, generator=g, dtype=torch.float32)
    old[~mask] = 0.0
    behaviour[~mask] = 0.0
    return old, behaviour, mask


RC_SETTINGS = [
    dict(rollout_is="token"),  # verl's default threshold 2.0
    dict(rollout_is="token", rollout_is_threshold=1.3, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold=5.0),
    dict(rollout_is="sequence", rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1", rollout_rs_threshold=2.0),
    dict(rollout_rs="token_k2", rollout_rs_threshold=0.05),
    dict(rollout_rs="token_k3", rollout_rs_threshold=0.05),
    dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.1),
    dict(rollout_rs="seq_sum_k2", rollout_rs_threshold=0.8),
    dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.08),
    dict(rollout_rs="seq_max_k2", rollout_rs_threshold=0.3),
    dict(rollout_rs="seq_max_k3,token_k1", rollout_rs_threshold=1.4),
    dict(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=1.5),
]


@pytest.mark.parametrize("setting", RC_SETTINGS, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in RC_SETTINGS])
@pytest.mark.parametrize("seed", range(3))
def test_rollout_correction_equals_verls_helper(seed, setting):
    """Weights and kept mask against verl's own compute_rollout_correction_and_rejection_mask."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    old, behaviour, mask = _mismatch(seed)
    w, keep, m = rollout_correction(old, behaviour, mask.long(), RolloutCorrectionConfig(**setting))
    theirs = dict(setting)
    theirs.setdefault("rollout_is_threshold", 2.0)
    w_ref, keep_ref, m_ref = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=behaviour, response_mask=mask.float(), **theirs)
    if setting.get("rollout_is"):
        torch.testing.assert_close(torch.where(mask, w, 0.0), torch.where(mask, w_ref.batch["rollout_is_weights"], 0.0))
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(m_ref["rollout_corr/rollout_is_mean"], rel=1e-5) or \
            setting.get("rollout_is_batch_normalize")
    else:
        assert w is None and w_ref is None
    assert torch.equal(keep, keep_ref.bool() & mask)
    if setting.get("rollout_rs"):
        assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1  # the rejection is exercised
        assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(m_ref["rollout_corr/rollout_rs_masked_fraction"])
        assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(
            m_ref["rollout_corr/rollout_rs_seq_masked_fraction"])
    assert m["rollout_corr/kl"] == pytest.approx(m_ref["rollout_corr/kl"], rel=1e-5, abs=1e-7)
    assert m["rollout_corr/k3_kl"] == pytest.approx(m_ref["rollout_corr/k3_kl"], rel=1e-5, abs=1e-7)


def test_tis_truncates_and_mis_rejects_exactly_the_out_of_bounds_tokens():
    """A hand case: log-ratios 0, log 3, -log 3, 0.1 on one row. TIS (token, 2): weights 1, 2, 1/3,
    e^0.1; MIS (token_k1, 2): the ratios 3 and 1/3 leave the mask, the others stay."""
    old = torch.tensor([[0.0, math.log(3.0), -math.log(3.0), 0.1]]) - 1.0
    behaviour = torch.full((1, 4), -1.0)
    mask = torch.ones(1, 4, dtype=torch.bool)
    w, keep, m = rollout_correction(old, behaviour, mask, RolloutCorrectionConfig(rollout_is="token"))
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 1 / 3, math.exp(0.1)]]))
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.25
    assert m["rollout_corr/log_ratio_max"] == pytest.approx(math.log(3.0))
    _, keep, m = rollout_correction(old, behaviour, mask, RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0))
    assert keep.tolist() == [[True, False, False, True]] and m["rollout_corr/rollout_rs_masked_fraction"] == 0.5
    _, keep, _ = rollout_correction(old, behaviour, mask, RolloutCorrectionConfig(rollout_rs="seq_max_k2", rollout_rs_threshold=0.5))
    assert keep.tolist() == [[False] * 4]  # log(3)^2 / 2 = 0.60 > 0.5: the whole row


def test_rollout_correction_options_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="loss.rollout_rs_threshold: expected a number > 0 with rollout_rs='token_k1', got None"):
        RolloutCorrectionConfig(rollout_rs="token_k1")
    with pytest.raises(ValueError, match="loss.rollout_rs: expected comma-separated options"):
        RolloutCorrectionConfig(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="loss.rollout_rs_threshold: only used with rollout_rs"):
        RolloutCorrectionConfig(rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="loss.rollout_rs_threshold: expected a number >= 1 with 'seq_mean_k1'"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold=0.5)
    from test_trainer import _cfg, _trainer
    from tokencredit.train.config import ConfigError

    cfg = _cfg(tmp_path, "grpo")
    cfg.loss.rollout_rs = "token_k9"
    cfg.loss.rollout_rs_threshold = 2.0
    with pytest.raises(ConfigError, match="loss.rollout_rs: expected") as e:
        _trainer(cfg)
    assert "\n" not in str(e.value)


def _perturbed_trainer(tmp_path, shift=1.0, **loss):
    """The own trainer whose rollout reports behaviour log-probs lowered by ``shift`` on every
    third response token (a deliberately mismatched sampler); the loss's masks and weights are
    recorded."""
    import dataclasses

    from test_trainer import _cfg, _trainer

    cfg = _cfg(tmp_path, "grpo", steps=1)
    cfg.rollout = dataclasses.replace(cfg.rollout, prompts_per_step=2, samples_per_prompt=4, max_new_tokens=6)
    cfg.log = dataclasses.replace(cfg.log, save_rollouts=False)
    for k, v in loss.items():
        setattr(cfg.loss, k, v)
    tr = _trainer(cfg)
    real = tr.rollout.generate

    def generate(*a, **k):
        rb = real(*a, **k)
        hit = (torch.arange(rb.response_ids.shape[1]) % 3 == 1)[None] & rb.response_mask.bool()
        return dataclasses.replace(rb, behaviour_logprobs=rb.behaviour_logprobs - shift * hit)

    tr.rollout.generate = generate
    seen = []
    loss_fn = tr.policy_update.loss

    def recording(lp, old, adv, m, cfg_, loss_weights=None):
        seen.append((m.detach().clone(), None if loss_weights is None else loss_weights.detach().clone()))
        return loss_fn(lp, old, adv, m, cfg_, loss_weights=loss_weights)

    tr.policy_update.loss = recording
    return tr, seen


def test_a_perturbed_behaviour_policy_tis_changes_the_update_and_mis_masks_the_perturbed_tokens(tmp_path):
    """Behaviour log-probs 1 nat too low on every third token: the logged log-ratio max is 1 (the
    rest is float noise between the sampler and the update's forward); TIS (token, 2) weights
    those tokens e^1 truncated to 2 and the update differs from the uncorrected one; MIS
    (token_k1, 2) masks exactly those tokens."""
    updates = {}
    for name, loss in (("none", {}), ("tis", dict(rollout_is="token")),
                       ("mis", dict(rollout_rs="token_k1", rollout_rs_threshold=2.0))):
        tr, seen = _perturbed_trainer(tmp_path / name, **loss)
        assert "logprobs" in tr.plan.policy or not loss  # the old log-probs are the update's, not the sampler's
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        m = tr.train_step()
        updates[name] = {n: p.detach() - before[n] for n, p in tr.model.named_parameters()}
        if not loss:
            # without a correction the old log-probs are the sampler's: no mismatch to see
            assert m["rollout_corr/log_ratio_max"] == 0.0
            continue
        mask = torch.cat([s[0] for s in seen]).bool()
        hit = (torch.arange(mask.shape[1]) % 3 == 1)[None]
        full = tr._last_batch["batch"].response_mask.bool()
        assert m["rollout_corr/log_ratio_max"] == pytest.approx(1.0, abs=1e-3)
        assert m["rollout_corr/log_ratio_min"] > -1e-3
        if name == "tis":
            w = torch.cat([s[1] for s in seen])
            torch.testing.assert_close(w[full & hit], torch.full((int((full & hit).sum()),), 2.0), rtol=0, atol=1e-3)
            torch.testing.assert_close(w[full & ~hit], torch.ones(int((full & ~hit).sum())), rtol=0, atol=1e-3)
            assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float((full & hit).sum() / full.sum()))
        else:
            assert torch.equal(mask, full & ~hit)
            assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(float((full & hit).sum() / full.sum()))
    for name in ("tis", "mis"):
        diff = max(float((updates[name][n] - updates["none"][n]).abs().max()) for n in updates["none"])
        assert diff > 1e-6, name


def test_with_bf16_the_trainer_logs_the_mismatch(tmp_path):
    """Under --precision bf16 the sampler is the bf16 copy and the old log-probs the update's: the
    logged log-ratio is the real training-inference mismatch (nonzero), every step."""
    import dataclasses

    from test_trainer import _cfg, _metrics, _trainer

    cfg = _cfg(tmp_path, "grpo", steps=2, precision="bf16")
    cfg.loss.rollout_is = "token"
    cfg.log = dataclasses.replace(cfg.log, save_rollouts=False)
    tr = _trainer(cfg)
    tr.train()
    rows = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for m in rows:
        assert m["rollout_corr/log_ratio_max"] > m["rollout_corr/log_ratio_min"]
        assert m["rollout_corr/log_ratio_max"] > 0 or m["rollout_corr/log_ratio_min"] < 0
        assert 0 < m["rollout_corr/rollout_is_mean"] <= 2.0
        assert "rollout_corr/rollout_rs_masked_fraction" in m
