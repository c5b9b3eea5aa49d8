"""Chunked per-token signals (logprobs, entropy, mode_prob) and the hidden-state residual."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencredit import CreditInputError
from tokencredit.engine.signals import SIGNAL_NAMES, default_chunk_rows, hidden_residual, token_signals

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def naive(logits, tokens, temperature=1.0):
    """The reference: a whole-batch log_softmax, in float64."""
    z = logits.to(torch.float64) / temperature
    lsm = torch.log_softmax(z, -1)
    p = lsm.exp()
    return {
        "logprobs": lsm.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        "entropy": torch.special.entr(p).sum(-1),  # 0 log 0 = 0 for masked vocabulary
        "mode_prob": p.amax(-1),
        "sum_pi_squared": p.square().sum(-1),
    }


def rand_case(B, T, V, dtype=torch.float64, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return logits, tokens


# ---- values against the naive computation ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000, None])  # 3, 7 do not divide 2*5; 1000 > B*T
@pytest.mark.parametrize("V", [1, 2, 11, 50])
def test_values_match_naive(dtype, temperature, chunk_size, V):
    logits, tokens = rand_case(2, 5, V, dtype, seed=V)
    out = token_signals(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    ref = naive(logits, tokens, temperature)
    assert set(out) == set(SIGNAL_NAMES)
    for k in SIGNAL_NAMES:
        assert out[k].shape == (2, 5)
        assert out[k].dtype == dtype
        torch.testing.assert_close(out[k], ref[k].to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_grad_path_values_equal_no_grad_path(dtype, chunk_size):
    logits, tokens = rand_case(3, 4, 9, dtype, seed=1)
    with torch.no_grad():
        a = token_signals(logits, tokens, temperature=0.8, chunk_size=chunk_size)
    b = token_signals(logits.clone().requires_grad_(), tokens, temperature=0.8, chunk_size=chunk_size)
    for k in SIGNAL_NAMES:
        assert b[k].requires_grad
        torch.testing.assert_close(b[k].detach(), a[k], rtol=0, atol=0)


def test_large_logits_are_stable():
    # logits near 1e4 in float32: lse - E[z] would cancel to ~1e-3 absolute error; the shifted
    # form keeps float32 accuracy (compared with float64 on the very same float32 values)
    logits, tokens = rand_case(2, 3, 20, torch.float32, seed=2, scale=1.0)
    shifted = logits + 1e4
    out = token_signals(shifted, tokens, chunk_size=2)
    ref = naive(shifted, tokens)
    for k in SIGNAL_NAMES:
        torch.testing.assert_close(out[k], ref[k].float(), rtol=1e-5, atol=1e-5)


def test_non_contiguous_logits_match_contiguous():
    # the trainer passes logits[:, P-1:-1], which cannot be flattened without a copy
    full, _ = rand_case(2, 9, 13, torch.float64, seed=3)
    sl = full[:, 2:7]
    assert not sl.is_contiguous()
    tokens = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(0))
    a = token_signals(sl, tokens, chunk_size=3, temperature=0.9)
    b = token_signals(sl.contiguous(), tokens, chunk_size=3, temperature=0.9)
    for k in SIGNAL_NAMES:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    # and with grad
    x = full.clone().requires_grad_()
    out = token_signals(x[:, 2:7], tokens, chunk_size=3)
    (out["logprobs"].sum() + out["entropy"].sum()).backward()
    x2 = full.clone().requires_grad_()
    ref = naive(x2[:, 2:7], tokens)
    (ref["logprobs"].sum() + ref["entropy"].sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_reduced_in_float32(dtype):
    logits, tokens = rand_case(2, 4, 300, dtype, seed=4)
    out = token_signals(logits, tokens, chunk_size=3)
    ref = naive(logits, tokens)  # the same (rounded) logits, in float64
    for k in SIGNAL_NAMES:
        assert out[k].dtype == torch.float32
        torch.testing.assert_close(out[k], ref[k].float(), rtol=1e-5, atol=1e-5)
    x = logits.clone().requires_grad_()
    token_signals(x, tokens, want=("logprobs",))["logprobs"].sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()


def test_minus_inf_logits_get_zero_probability():
    logits, tokens = rand_case(2, 3, 10, torch.float64, seed=5)
    logits[..., 7:] = -math.inf  # a masked vocabulary tail; sampled tokens stay below it
    tokens = tokens % 7
    out = token_signals(logits, tokens, chunk_size=4)
    ref = naive(logits, tokens)
    for k in SIGNAL_NAMES:
        assert torch.isfinite(out[k]).all()
        torch.testing.assert_close(out[k], ref[k], **TOL[torch.float64])
    x = logits.clone().requires_grad_()
    o = token_signals(x, tokens, chunk_size=4)
    # upstream grads > 1: a floor of finfo.min would overflow to -inf here and give 0 * inf = NaN
    (o["logprobs"].sum() + 3.0 * o["entropy"].sum() + o["mode_prob"].sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[..., 7:] == 0).all()


# ---- gradients -----------------------------------------------------------------------


@pytest.mark.parametrize("want", [("logprobs",), ("entropy",), ("mode_prob",), ("logprobs", "entropy"), SIGNAL_NAMES])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck(want, temperature):
    logits, tokens = rand_case(2, 3, 5, torch.float64, seed=6)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: tuple(token_signals(x, tokens, temperature=temperature, chunk_size=4, want=want).values()), (x,)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [1, 5, 100])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradients_equal_naive_gradients(dtype, chunk_size, temperature):
    logits, tokens = rand_case(3, 4, 17, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    up = {k: torch.randn(3, 4, generator=g, dtype=torch.float64) for k in SIGNAL_NAMES}

    x = logits.clone().requires_grad_()
    out = token_signals(x, tokens, temperature=temperature, chunk_size=chunk_size)
    sum((out[k].double() * up[k]).sum() for k in SIGNAL_NAMES).backward()

    x_ref = logits.clone().requires_grad_()
    ref = naive(x_ref, tokens, temperature)
    sum((ref[k] * up[k]).sum() for k in SIGNAL_NAMES).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[dtype])


def test_unused_outputs_need_no_gradient():
    logits, tokens = rand_case(2, 3, 6, torch.float64, seed=9)
    x = logits.clone().requires_grad_()
    out = token_signals(x, tokens)
    out["entropy"].sum().backward()  # logprobs and mode_prob never reach the loss
    x_ref = logits.clone().requires_grad_()
    naive(x_ref, tokens)["entropy"].sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL[torch.float64])


def test_no_graph_under_no_grad():
    logits, tokens = rand_case(2, 3, 6, torch.float32, seed=10)
    x = logits.requires_grad_()
    with torch.no_grad():
        out = token_signals(x, tokens)
    assert not any(v.requires_grad for v in out.values())


def test_backward_saves_only_row_statistics():
    # the custom Function saves the logits (already alive) and O(B*T) row statistics; naive
    # autograd saves at least one [B*T, V] copy. This is what bounds the training memory.
    B, T, V = 2, 8, 512
    logits, tokens = rand_case(B, T, V, torch.float32, seed=11)
    x = logits.requires_grad_()

    def saved_bytes(fn):
        seen = []

        def pack(t):
            if t.data_ptr() != x.data_ptr():  # saving the input itself costs nothing
                seen.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return sum(seen), out

    fused, out = saved_bytes(lambda: token_signals(x, tokens, chunk_size=4))
    naive_bytes, _ = saved_bytes(lambda: naive(x, tokens))
    assert fused <= 8 * B * T * 8  # a few [N] vectors
    assert naive_bytes >= B * T * V * 4
    (out["logprobs"].sum() + out["entropy"].sum()).backward()
    assert torch.isfinite(x.grad).all()


# ---- ranges (hypothesis) -------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    V=st.integers(1, 40),
    scale=st.sampled_from([0.0, 0.1, 1.0, 10.0, 100.0]),
    temperature=st.floats(0.05, 5.0),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_entropy_and_mode_prob_ranges(V, scale, temperature, chunk, seed, dtype):
    logits, tokens = rand_case(2, 3, V, dtype, seed=seed, scale=scale)
    out = token_signals(logits, tokens, temperature=temperature, chunk_size=chunk)
    eps = 1e-6 if dtype == torch.float32 else 1e-12
    H, mp, lp = out["entropy"], out["mode_prob"], out["logprobs"]
    assert (H >= 0).all() and (H <= math.log(V) + eps).all()
    assert (mp >= 1.0 / V - eps).all() and (mp <= 1 + eps).all()
    assert (lp <= eps).all()
    # log pi(y) <= log p*, and p* = 1 with H = 0 for V = 1
    assert (lp <= mp.log() + eps).all()
    if V == 1 or scale == 0.0:
        torch.testing.assert_close(H, torch.full_like(H, math.log(V)), atol=1e-5, rtol=0)
        torch.testing.assert_close(mp, torch.full_like(mp, 1.0 / V), atol=1e-5, rtol=0)


# ---- options -------------------------------------------------------------------------


def test_want_subset_order_and_repeats():
    logits, tokens = rand_case(2, 3, 6, torch.float64, seed=12)
    full = token_signals(logits, tokens)
    out = token_signals(logits, tokens, want=("mode_prob", "logprobs", "mode_prob"))
    assert list(out) == ["mode_prob", "logprobs"]
    out1 = token_signals(logits, tokens, want="entropy")
    assert list(out1) == ["entropy"]
    torch.testing.assert_close(out1["entropy"], full["entropy"], rtol=0, atol=0)
    torch.testing.assert_close(out["logprobs"], full["logprobs"], rtol=0, atol=0)


def test_empty_batch():
    logits = torch.zeros(2, 0, 5)
    out = token_signals(logits, torch.zeros(2, 0, dtype=torch.long))
    assert all(v.shape == (2, 0) for v in out.values())


def test_default_chunk_bounds_temporaries():
    V = 32_000
    for N in (1, 10, 1000, 100_000):
        rows = default_chunk_rows(N, V, torch.float32)
        assert 1 <= rows <= N
        chunk_bytes = rows * V * 4
        assert chunk_bytes <= max(N * V * 4 // 32, 4 << 20)
        assert chunk_bytes <= 64 << 20
    # bf16 logits are upcast per chunk: the chunk is sized in float32 bytes
    assert default_chunk_rows(100_000, V, torch.bfloat16) * V * 4 <= max(100_000 * V * 2 // 32, 4 << 20)


# ---- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda l, t: dict(logits=l[0], tokens=t), "logits"),
        (lambda l, t: dict(logits=l.long(), tokens=t), "logits"),
        (lambda l, t: dict(logits=l.numpy(), tokens=t), "logits"),
        (lambda l, t: dict(logits=l, tokens=t[:, :2]), "tokens"),
        (lambda l, t: dict(logits=l, tokens=t.double()), "tokens"),
        (lambda l, t: dict(logits=l, tokens=t.bool()), "tokens"),
        (lambda l, t: dict(logits=l, tokens=torch.full_like(t, 6)), "tokens"),
        (lambda l, t: dict(logits=l, tokens=torch.full_like(t, -1)), "tokens"),
        (lambda l, t: dict(logits=l, tokens=t, temperature=0.0), "temperature"),
        (lambda l, t: dict(logits=l, tokens=t, temperature=-1.0), "temperature"),
        (lambda l, t: dict(logits=l, tokens=t, temperature=float("nan")), "temperature"),
        (lambda l, t: dict(logits=l, tokens=t, temperature=float("inf")), "temperature"),
        (lambda l, t: dict(logits=l, tokens=t, temperature=True), "temperature"),
        (lambda l, t: dict(logits=l, tokens=t, temperature="1"), "temperature"),
        (lambda l, t: dict(logits=l, tokens=t, chunk_size=0), "chunk_size"),
        (lambda l, t: dict(logits=l, tokens=t, chunk_size=2.5), "chunk_size"),
        (lambda l, t: dict(logits=l, tokens=t, want=()), "want"),
        (lambda l, t: dict(logits=l, tokens=t, want=("logprob",)), "want"),
    ],
)
def test_errors_name_the_field(make, field):
    logits, tokens = rand_case(2, 3, 6, torch.float32, seed=13)
    kw = make(logits, tokens)
    with pytest.raises(CreditInputError, match=field):
        token_signals(kw.pop("logits"), kw.pop("tokens"), **kw)


def test_error_message_says_expected_and_got():
    logits, tokens = rand_case(2, 3, 6, torch.float32, seed=14)
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, 5\].*got 9"):
        token_signals(logits, torch.full_like(tokens, 9))
    with pytest.raises(ValueError, match=r"temperature: expected .*> 0, got 0"):
        token_signals(logits, tokens, temperature=0)


# ---- hidden residual -----------------------------------------------------------------


def test_hidden_residual_is_l2_norm():
    g = torch.Generator().manual_seed(15)
    a = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    b = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    r = hidden_residual(a, b)
    assert r.shape == (2, 3)
    torch.testing.assert_close(r, ((a - b) ** 2).sum(-1).sqrt(), **TOL[torch.float64])
    assert (hidden_residual(a, a) == 0).all()
    # hand case: a 3-4-5 triangle
    h = torch.tensor([[[3.0, 4.0]]])
    assert hidden_residual(h, torch.zeros_like(h)).item() == 5.0


def test_hidden_residual_half_inputs_reduce_in_float32():
    a = torch.full((1, 2, 4096), 1.0, dtype=torch.bfloat16)
    b = torch.zeros_like(a)
    r = hidden_residual(a, b)
    assert r.dtype == torch.float32
    torch.testing.assert_close(r, torch.full((1, 2), 64.0))


@pytest.mark.parametrize(
    "a, b, field",
    [
        (torch.zeros(2, 3), torch.zeros(2, 3), "h_adapted"),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), "h_base"),
        (torch.zeros(2, 3, 4, dtype=torch.long), torch.zeros(2, 3, 4, dtype=torch.long), "h_adapted"),
        (torch.zeros(2, 3, 4), "x", "h_base"),
    ],
)
def test_hidden_residual_errors(a, b, field):
    with pytest.raises(CreditInputError, match=field):
        hidden_residual(a, b)
