"""Policy losses, aggregation, KL penalties and DAPO's reward-side pieces.

Hand-computed values and gradients on tiny tensors (float64), plus hypothesis properties:
finite output, zero gradient at padding (even with NaN there), padding invariance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit.credit.losses import (
    AGG_MODES,
    KL_KINDS,
    PPOLossConfig,
    SAPOLossConfig,
    add_kl_penalty,
    aggregate,
    get_policy_loss,
    kl_penalty,
    list_policy_losses,
    register_policy_loss,
)
from tokencredit.train.dapo import dynamic_sampling_filter, overlong_penalty

D = torch.float64


def _t(x):
    return torch.tensor(x, dtype=D)


def _one_token(name, ratio, adv, **cfg):
    """Loss and d loss / d logprob of a single token with old logprob 0 and ratio ``ratio``."""
    lp = _t([[math.log(ratio)]]).requires_grad_()
    loss, metrics = get_policy_loss(name)(lp, _t([[0.0]]), _t([[adv]]), torch.ones(1, 1, dtype=torch.bool), cfg)
    (g,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), float(g), metrics


# -- ppo: hand values and gradients ------------------------------------------------------

# (A, r, config, expected loss, expected d loss / d log r)
# inside the band: l = -A r, grad -A r; clipped: constant, grad 0
PPO_CASES = [
    (2.0, 1.1, {}, -2.2, -2.2),  # A>0 inside
    (2.0, 1.5, {}, -2.0 * 1.2, 0.0),  # A>0 above 1+eps: clipped
    (2.0, 0.5, {}, -1.0, -1.0),  # A>0 below 1-eps: pessimistic min keeps the ratio
    (-2.0, 0.9, {}, 1.8, 1.8),  # A<0 inside
    (-2.0, 0.5, {}, 2.0 * 0.8, 0.0),  # A<0 below 1-eps: clipped
    (-2.0, 1.5, {}, 3.0, 3.0),  # A<0 above 1+eps: not clipped (loss grows with r)
    (-2.0, 5.0, {}, 10.0, 10.0),  # ... unboundedly without dual-clip
    (-2.0, 5.0, {"dual_clip": 3.0}, 6.0, 0.0),  # dual-clip active: capped at -A c
    (-2.0, 2.5, {"dual_clip": 3.0}, 5.0, 5.0),  # dual-clip not reached
    (2.0, 5.0, {"dual_clip": 3.0}, -2.4, 0.0),  # dual-clip never acts for A>0
    (0.0, 1.5, {}, 0.0, 0.0),
]


@pytest.mark.parametrize("adv,r,cfg,loss,grad", PPO_CASES)
def test_ppo_hand_values_and_gradients(adv, r, cfg, loss, grad):
    got_loss, got_grad, _ = _one_token("ppo", r, adv, **cfg)
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_clip_higher_asymmetry():
    sym = {"clip_low": 0.2, "clip_high": 0.2}
    dapo = {"clip_low": 0.2, "clip_high": 0.28}
    # r = 1.25 > 1.2: clipped by the symmetric band, still inside the DAPO band for A > 0
    assert _one_token("ppo", 1.25, 1.0, **sym)[1] == 0.0
    l, g, _ = _one_token("ppo", 1.25, 1.0, **dapo)
    assert (l, g) == (pytest.approx(-1.25), pytest.approx(-1.25))
    # r = 1.3 > 1.28: clipped at 1 + clip_high
    l, g, _ = _one_token("ppo", 1.3, 1.0, **dapo)
    assert (l, g) == (pytest.approx(-1.28), 0.0)
    # the low side is unchanged by clip-higher: r = 0.78 < 0.8 is clipped for A < 0
    l, g, _ = _one_token("ppo", 0.78, -1.0, **dapo)
    assert (l, g) == (pytest.approx(0.8), 0.0)


def test_ppo_clip_metrics_and_token_mean():
    # four tokens: A>0 clipped high, A<0 clipped low, A<0 dual-clipped, A>0 inside; one padding
    r = _t([[1.5, 0.5, 4.0], [1.1, 1.0, 1.0]])
    adv = _t([[1.0, -1.0, -1.0], [1.0, float("nan"), 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    lp = r.log().requires_grad_()
    loss, m = get_policy_loss("ppo")(lp, torch.zeros_like(r), adv, mask, {"dual_clip": 3.0})
    per_tok = [-1.2, 0.8, 3.0, -1.1]
    assert float(loss.detach()) == pytest.approx(sum(per_tok) / 4)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _t([[0.0, 0.0, 0.0], [-1.1 / 4, 0.0, 0.0]]))
    assert m["ppo/clip_frac_high"] == 0.25 and m["ppo/clip_frac_low"] == 0.25
    assert m["ppo/clip_frac"] == 0.5 and m["ppo/dual_clip_frac"] == 0.25
    assert m["ppo/ratio_max"] == pytest.approx(4.0) and m["ppo/ratio_min"] == pytest.approx(0.5)
    assert m["ppo/ratio_mean"] == pytest.approx((1.5 + 0.5 + 4.0 + 1.1) / 4)
    logs = [math.log(x) for x in (1.5, 0.5, 4.0, 1.1)]
    assert m["ppo/ppo_kl"] == pytest.approx(-sum(logs) / 4)
    assert m["ppo/approx_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 4)


# -- sapo --------------------------------------------------------------------------------


def _sig(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("adv,r", [(1.0, 1.0), (1.0, 1.7), (2.0, 0.4), (-1.0, 1.0), (-1.5, 1.5), (-1.0, 0.3)])
def test_sapo_gate_value_and_gradient(adv, r):
    tau = 1.0 if adv > 0 else 1.05
    s = _sig(tau * (r - 1))
    loss, grad, m = _one_token("sapo", r, adv)
    assert loss == pytest.approx(-s * 4 / tau * adv, abs=1e-12)
    # d/d log r of -A f(r) = -A * f'(r) * r, f'(r) = 4 s (1 - s) (tau cancels)
    assert grad == pytest.approx(-adv * 4 * s * (1 - s) * r, abs=1e-12)
    assert m["sapo/gate_mean"] == pytest.approx(4 * s / tau)
    assert m["sapo/grad_weight_mean"] == pytest.approx(4 * s * (1 - s))


def test_sapo_on_policy_matches_vanilla_gradient_and_decays_off_policy():
    # at r = 1 the gate has slope 1: SAPO's gradient equals the unclipped surrogate's
    assert _one_token("sapo", 1.0, 1.0)[1] == pytest.approx(-1.0)
    assert _one_token("sapo", 1.0, -1.0)[1] == pytest.approx(1.0)
    # far off-policy the gradient is attenuated smoothly, never exactly zero
    g = [abs(_one_token("sapo", r, 1.0)[1] / r) for r in (1.0, 2.0, 4.0, 8.0)]
    assert g[0] > g[1] > g[2] > g[3] > 0


def test_sapo_default_aggregation_is_seq_mean_token_mean():
    assert SAPOLossConfig().agg_mode == "seq-mean-token-mean"
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = _t([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    lp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    loss, _ = get_policy_loss("sapo")(lp, torch.zeros_like(lp), adv, mask)
    row0, row1 = -2.0, 2.0 / 1.05  # gate at r = 1 is 2 / tau
    assert float(loss.detach()) == pytest.approx((row0 + row1) / 2)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _t([[-1 / 6, -1 / 6, -1 / 6], [0.5, 0.0, 0.0]]))


def test_sapo_temperatures_by_sign():
    a = _one_token("sapo", 1.5, -1.0, tau_neg=1.0)[0]
    b = _one_token("sapo", 1.5, -1.0)[0]
    assert a != pytest.approx(b)
    assert _one_token("sapo", 1.5, 1.0, tau_neg=3.0)[0] == pytest.approx(_one_token("sapo", 1.5, 1.0)[0])


# -- loss weights ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "sapo"])
def test_loss_weights_multiply_the_per_token_loss(name):
    r = _t([[1.1, 0.9, 1.3]])
    adv = _t([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = _t([[0.5, 2.0, 0.0]])
    cfg = {"agg_mode": "token-sum"}
    fn = get_policy_loss(name)
    lp = r.log().requires_grad_()
    lw, _ = fn(lp, torch.zeros_like(r), adv, mask, cfg, loss_weights=w)
    (gw,) = torch.autograd.grad(lw, lp)
    grads, losses = [], []
    for i in range(3):  # token by token, unweighted
        lpi = r[:, i:i + 1].log().requires_grad_()
        li, _ = fn(lpi, torch.zeros(1, 1, dtype=D), adv[:, i:i + 1], torch.ones(1, 1), cfg)
        losses.append(float(li.detach()))
        grads.append(float(torch.autograd.grad(li, lpi)[0]))
    assert float(lw.detach()) == pytest.approx(sum(wi * li for wi, li in zip(w[0].tolist(), losses)))
    torch.testing.assert_close(gw, w * _t([grads]))
    assert gw[0, 2] == 0.0


def test_loss_weights_reject_negative_and_nonfinite():
    x = torch.zeros(1, 2, dtype=D)
    m = torch.ones(1, 2)
    with pytest.raises(ValueError, match="loss_weights"):
        get_policy_loss("ppo")(x, x, x, m, loss_weights=_t([[1.0, -0.5]]))
    with pytest.raises(ValueError, match="loss_weights"):
        get_policy_loss("ppo")(x, x, x, m, loss_weights=_t([[1.0, float("inf")]]))
    # at padding anything goes
    get_policy_loss("ppo")(x, x, x, torch.tensor([[1, 0]]), loss_weights=_t([[1.0, float("nan")]]))


# -- aggregation -------------------------------------------------------------------------

LOSS_MAT = [[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")], [9.0, 9.0, 9.0]]
MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]  # the last row is empty: excluded from seq-mean
AGG_CASES = {
    "token-mean": (10 / 4, [[1 / 4] * 3, [1 / 4, 0, 0]]),
    "token-sum": (10.0, [[1.0] * 3, [1.0, 0, 0]]),
    "seq-mean-token-mean": ((2 + 4) / 2, [[1 / 6] * 3, [1 / 2, 0, 0]]),
    "seq-mean-token-sum": ((6 + 4) / 2, [[1 / 2] * 3, [1 / 2, 0, 0]]),
    "seq-mean-token-sum-norm": ((6 / 3 + 4 / 3) / 2, [[1 / 6] * 3, [1 / 6, 0, 0]]),
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_hand_values_and_gradients(mode):
    value, grad = AGG_CASES[mode]
    x = _t(LOSS_MAT).requires_grad_()
    out = aggregate(x, torch.tensor(MASK), mode)
    assert float(out.detach()) == pytest.approx(value)
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(g, _t(grad + [[0, 0, 0]]))
    # dropping the empty row changes nothing
    assert float(aggregate(_t(LOSS_MAT[:2]), torch.tensor(MASK[:2]), mode)) == pytest.approx(value)


def test_sum_norm_constant():
    out = aggregate(_t(LOSS_MAT), torch.tensor(MASK), "seq-mean-token-sum-norm", norm_constant=10)
    assert float(out) == pytest.approx((6 / 10 + 4 / 10) / 2)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_empty_aggregates_to_zero(mode):
    x = _t([[float("nan"), 1.0]]).requires_grad_()
    out = aggregate(x, torch.zeros(1, 2, dtype=torch.bool), mode)
    assert float(out.detach()) == 0.0
    (g,) = torch.autograd.grad(out, x)
    assert torch.equal(g, torch.zeros_like(g))


def test_aggregation_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"agg_mode.*token-mean.*seq-mean-token-sum-norm.*'mean'"):
        aggregate(x, m, "mean")
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(x, m, "token-mean", norm_constant=4)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(x, m, "seq-mean-token-sum-norm", norm_constant=0)
    with pytest.raises(ValueError, match=r"mask.*\(2, 3\).*\(2, 4\)"):
        aggregate(x, torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="mask.*0/1"):
        aggregate(x, torch.full((2, 3), 0.5), "token-mean")


# -- KL ----------------------------------------------------------------------------------

L_CUR = [[-1.0, -2.0, -0.5, -3.0]]
L_REF = [[-1.5, -1.0, -0.5, -2.0]]


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_hand_values_and_gradients(kind):
    lp = _t(L_CUR).requires_grad_()
    out = kl_penalty(lp, _t(L_REF), kind)
    d = [a - b for a, b in zip(L_CUR[0], L_REF[0])]
    if kind == "k1":
        val, grad = d, [1.0] * 4
    elif kind == "k2":
        val, grad = [0.5 * x * x for x in d], d
    else:
        val = [math.exp(-x) + x - 1 for x in d]
        grad = [1 - math.exp(-x) for x in d]  # d/dl of exp(ref - l) - (ref - l) - 1
    torch.testing.assert_close(out, _t([val]))
    (g,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(g, _t([grad]))


def test_k3_is_clamped_like_verl():
    lp = _t([[-6.0, -0.0, -20.0]]).requires_grad_()
    ref = _t([[-1.0, -15.0, -19.0]])  # ref - l = 5 (exp -> 142), -15 (-> 14), 1 (-> e - 2)
    out = kl_penalty(lp, ref, "k3")
    torch.testing.assert_close(out, _t([[10.0, 10.0, math.e - 2]]))
    (g,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(g, _t([[0.0, 0.0, 1 - math.e]]))


def test_kl_mask_zeroes_padding_and_its_gradient():
    lp = _t([[-1.0, -2.0]]).requires_grad_()
    ref = _t([[-1.5, float("nan")]])
    for kind in KL_KINDS:
        out = kl_penalty(lp, ref, kind, torch.tensor([[1, 0]]))
        assert out[0, 1] == 0.0 and torch.isfinite(out).all()
        (g,) = torch.autograd.grad(out.sum(), lp)
        assert g[0, 1] == 0.0
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(lp, ref, "k3")  # without a mask every position is valid


def test_add_kl_penalty():
    lp = _t(L_CUR).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])
    base = torch.tensor(1.0, dtype=D)
    loss, m = add_kl_penalty(base, lp, _t(L_REF), mask, beta=0.1, kind="k1")
    kl = (0.5 - 1.0 + 0.0) / 3
    assert float(loss.detach()) == pytest.approx(1.0 + 0.1 * kl) and m["kl/value"] == pytest.approx(kl)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _t([[0.1 / 3] * 3 + [0.0]]))
    assert add_kl_penalty(base, lp, None, mask, beta=0.0) == (base, {})
    with pytest.raises(ValueError, match="ref_logprobs"):
        add_kl_penalty(base, lp, None, mask, beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        add_kl_penalty(base, lp, _t(L_REF), mask, beta=-1.0)
    with pytest.raises(ValueError, match=r"kind.*k1.*'k4'"):
        kl_penalty(lp, _t(L_REF), "k4")


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "sapo"])
@pytest.mark.parametrize("field", ["old_logprobs", "advantages", "response_mask", "loss_weights"])
def test_shape_mismatch_names_field_and_both_shapes(name, field):
    args = {"logprobs": torch.zeros(2, 3), "old_logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2, 3),
            "response_mask": torch.ones(2, 3), "loss_weights": torch.ones(2, 3)}
    args[field] = torch.zeros(2, 4)
    w = args.pop("loss_weights")
    with pytest.raises(ValueError, match=rf"{field}.*\(2, 3\).*\(2, 4\)"):
        get_policy_loss(name)(*args.values(), loss_weights=w)


@pytest.mark.parametrize("name", ["ppo", "sapo"])
@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "advantages"])
def test_nonfinite_on_valid_positions_names_field(name, field):
    args = {"logprobs": torch.zeros(2, 3), "old_logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2, 3)}
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    args[field] = args[field].clone()
    args[field][0, 2] = float("nan")  # padding: fine
    get_policy_loss(name)(*args.values(), mask)
    args[field][1, 0] = float("inf")
    with pytest.raises(ValueError, match=rf"^{field}: .*finite"):
        get_policy_loss(name)(*args.values(), mask)


@pytest.mark.parametrize("name,cfg,field", [
    ("ppo", {"clip_low": 1.0}, "clip_low"),
    ("ppo", {"clip_high": -0.1}, "clip_high"),
    ("ppo", {"dual_clip": 1.0}, "dual_clip"),
    ("ppo", {"agg_mode": "sum"}, "agg_mode"),
    ("ppo", {"norm_constant": 5.0}, "norm_constant"),
    ("sapo", {"tau_pos": 0.0}, "tau_pos"),
    ("sapo", {"tau_neg": float("nan")}, "tau_neg"),
    ("sapo", {"log_ratio_clamp": 0}, "log_ratio_clamp"),
    ("ppo", {"nope": 1}, "nope"),
])
def test_config_errors(name, cfg, field):
    with pytest.raises(ValueError, match=field):
        get_policy_loss(name).make_config(cfg)


def test_registry():
    assert {"ppo", "sapo"} <= set(list_policy_losses())
    info = get_policy_loss("ppo")
    assert info.config_cls is PPOLossConfig and info.provenance == "paper"
    assert get_policy_loss("sapo").provenance == "ref-code"
    with pytest.raises(KeyError, match="unknown policy loss 'nope'.*ppo"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo", config=PPOLossConfig, provenance="paper", summary="x")
    # the trainer builds the config from its own fields and calls with 5 positional args
    lp = torch.zeros(2, 2, requires_grad=True)
    loss, m = info(lp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.long),
                   PPOLossConfig(clip_high=0.28))
    assert float(loss.detach()) == -1.0 and all(isinstance(v, float) for v in m.values())


# -- hypothesis properties ---------------------------------------------------------------


@st.composite
def loss_inputs(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=D) * 6
    old = lp + torch.randn(B, T, generator=g, dtype=D) * draw(st.sampled_from([0.0, 0.1, 1.0, 5.0]))
    adv = torch.randn(B, T, generator=g, dtype=D) * 3
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    # padding holds garbage: it must be read neither by the value nor by the gradient
    lp = torch.where(mask, lp, float("nan"))
    old = torch.where(mask, old, float("nan"))
    adv = torch.where(mask, adv, float("inf"))
    w = torch.where(mask, torch.rand(B, T, generator=g, dtype=D) * 2, float("nan"))
    return lp, old, adv, mask, w


def _run(name, lp, old, adv, mask, cfg, w=None):
    lp = lp.clone().requires_grad_()
    loss, metrics = get_policy_loss(name)(lp, old, adv, mask, cfg, loss_weights=w)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, metrics


@settings(max_examples=30, deadline=None)
@given(loss_inputs(), st.sampled_from(["ppo", "sapo"]), st.sampled_from(AGG_MODES), st.booleans())
def test_finite_and_zero_gradient_at_padding(inp, name, mode, weighted):
    lp, old, adv, mask, w = inp
    cfg = {"agg_mode": mode, **({"dual_clip": 3.0} if name == "ppo" else {})}
    loss, g, metrics = _run(name, lp, old, adv, mask, cfg, w if weighted else None)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.equal(g[~mask], torch.zeros_like(g[~mask]))
    assert all(math.isfinite(v) for v in metrics.values())


@settings(max_examples=30, deadline=None)
@given(loss_inputs(), st.sampled_from(["ppo", "sapo"]), st.integers(1, 4),
       st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"]))
def test_padding_invariance(inp, name, extra, mode):
    lp, old, adv, mask, w = inp
    B = lp.shape[0]

    def pad(x, fill):
        return torch.cat([x, torch.full((B, extra), fill, dtype=x.dtype)], 1)

    cfg = {"agg_mode": mode}
    loss, g, _ = _run(name, lp, old, adv, mask, cfg, w)
    loss_p, g_p, _ = _run(name, pad(lp, -1.0), pad(old, float("nan")), pad(adv, float("nan")),
                          pad(mask, False), cfg, pad(w, float("nan")))
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(g_p[:, : lp.shape[1]], g)


@settings(max_examples=30, deadline=None)
@given(loss_inputs(), st.integers(1, 4))
def test_sum_norm_default_constant_scales_with_padding(inp, extra):
    """By design (verl): with C = T, padding by `extra` scales the loss by T / (T + extra)."""
    lp, old, adv, mask, _ = inp
    B, T = lp.shape
    pad = lambda x: torch.cat([x, torch.zeros(B, extra, dtype=x.dtype)], 1)  # noqa: E731
    mode = {"agg_mode": "seq-mean-token-sum-norm"}
    loss, _, _ = _run("ppo", lp, old, adv, mask, mode)
    loss_p, _, _ = _run("ppo", pad(lp), pad(old), pad(adv), pad(mask), mode)
    torch.testing.assert_close(loss_p, loss * T / (T + extra))
    fixed = {**mode, "norm_constant": 16.0}
    torch.testing.assert_close(_run("ppo", pad(lp), pad(old), pad(adv), pad(mask), fixed)[0],
                               _run("ppo", lp, old, adv, mask, fixed)[0])


@settings(max_examples=30, deadline=None)
@given(loss_inputs(), st.sampled_from(KL_KINDS), st.sampled_from(AGG_MODES))
def test_kl_properties(inp, kind, mode):
    lp, old, _, mask, _ = inp
    lp = lp.clone().requires_grad_()
    kl = kl_penalty(lp, old, kind, mask)
    assert torch.isfinite(kl).all() and torch.equal(kl[~mask], torch.zeros_like(kl[~mask]))
    if kind != "k1":
        assert (kl >= 0).all()
    (g,) = torch.autograd.grad(aggregate(kl, mask, mode), lp)
    assert torch.isfinite(g).all() and torch.equal(g[~mask], torch.zeros_like(g[~mask]))


# -- DAPO reward-side pieces -------------------------------------------------------------


def test_overlong_penalty_hand_cases():
    L = torch.tensor([0, 10, 16, 17, 18, 20])
    out = overlong_penalty(L, max_len=20, cache_len=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0]))
    assert out[-1] == -1.0  # exactly -1 at L = L_max
    torch.testing.assert_close(overlong_penalty(L, 20, 4, factor=0.5), out * 0.5)
    torch.testing.assert_close(overlong_penalty([3, 4], 4, 4), torch.tensor([-0.75, -1.0]))  # C = L_max
    assert overlong_penalty(torch.tensor([5.0]), 8, 2).dtype == torch.float32


@pytest.mark.parametrize("kw,field", [
    ({"max_len": 0, "cache_len": 4}, "max_len"),
    ({"max_len": 20, "cache_len": 0}, "cache_len"),
    ({"max_len": 20, "cache_len": 21}, "cache_len"),
    ({"max_len": 20, "cache_len": 4, "factor": -1.0}, "factor"),
])
def test_overlong_penalty_errors(kw, field):
    with pytest.raises(ValueError, match=field):
        overlong_penalty(torch.tensor([1]), **kw)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.tensor([[1]]), 20, 4)


def test_dynamic_sampling_filter_hand_cases():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1e-7, 3.0])
    groups = torch.tensor([7, 7, 2, 2, 9, 9, 9, 4, 4, 4, 5])  # 5 is a singleton
    keep = dynamic_sampling_filter(rewards, groups)
    assert keep.dtype == torch.bool
    # verl's DAPO recipe keeps a singleton group (std > 0 or len == 1); opt out to drop it
    assert keep.tolist() == [False, False, True, True, False, False, False, True, True, True, True]
    keep = dynamic_sampling_filter(rewards, groups, keep_singletons=False)
    assert keep.tolist() == [False, False, True, True, False, False, False, True, True, True, False]
    # a singleton is kept whatever its reward; a group of two equal rewards is not
    assert dynamic_sampling_filter([1.0, 0.0, 1.0, 1.0], [0, 1, 2, 2]).tolist() == [True, True, False, False]
    # interleaved groups and list inputs
    assert dynamic_sampling_filter([0, 1, 0, 1], [0, 1, 0, 1]).tolist() == [False] * 4
    assert dynamic_sampling_filter([0, 1, 1, 1], [0, 1, 0, 1]).tolist() == [True, False, True, False]
    assert dynamic_sampling_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="group_ids"):
        dynamic_sampling_filter(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="rewards"):
        dynamic_sampling_filter(torch.tensor([0.0, float("nan")]), torch.zeros(2))
    with pytest.raises(ValueError, match="keep_singletons"):
        dynamic_sampling_filter(torch.zeros(2), torch.zeros(2), keep_singletons=1)
