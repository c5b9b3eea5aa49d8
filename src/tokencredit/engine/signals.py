"""Per-token signals from logits, computed in row chunks so the vocabulary axis is never copied whole.

For logits ``x [B, T, V]``, sampled tokens ``y [B, T]`` and temperature ``tau``, with
``z = x / tau``, ``m = max_v z_v``, ``d = z - m`` and ``s = sum_v exp(d_v)``:

    logprobs   l_t = log pi(y_t) = d_{y_t} - log s
    entropy    H_t = -sum_v p_v log p_v = log s - sum_v exp(d_v) d_v / s
    mode_prob  p*_t = max_v p_v = exp(m - lse) = 1 / s
    sum_pi_squared  S_t = sum_v p_v^2 = sum_v exp(2 d_v) / s^2   (verl's ``sum_pi_squared``,
               ``exp(logsumexp(2 z) - 2 logsumexp(z))``; OTB's per-token variance proxy)

Every quantity is read off one shifted row ``d`` and its exponent, so a chunk of rows costs two
chunk-sized temporaries and the full ``[B*T, V]`` ``log_softmax``/``softmax`` copies of the naive
computation never exist. Entropy uses the shifted logits (``d <= 0``) rather than
``lse - sum p z``, which would cancel catastrophically when the logits are large.

Gradients. Under autograd, torch would keep each chunk's intermediates alive for backward,
which is as much memory as the naive copies. When grad is needed, the computation therefore
goes through :class:`_FusedSignals`, a custom ``autograd.Function`` that saves only the logits
(already alive), the tokens and three ``[N]`` row statistics, and recomputes ``p`` chunk by
chunk in backward::

    dl/dz   = onehot(y) - p
    dH/dz   = -p (log p + H)
    dp*/dz  = p* (onehot(argmax) - p)
    dS/dz   = 2 p (p - S)
    dx      = dz / tau

Half-precision logits are upcast to float32 one chunk at a time; outputs are float32 for
half inputs and the logits' dtype otherwise. Logits of ``-inf`` (masked vocabulary) are
allowed: they get probability 0 and contribute 0 to the entropy and to the gradient.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
from torch import Tensor

from ..credit.batch import CreditInputError

__all__ = ["SIGNAL_NAMES", "token_signals", "hidden_residual", "default_chunk_rows"]

#: the signals :func:`token_signals` can compute
SIGNAL_NAMES = ("logprobs", "entropy", "mode_prob", "sum_pi_squared")

# A chunk's temporaries (two chunk-sized buffers in the compute dtype) are kept to ~1/16 of the
# logits' own memory. The floor keeps tiny inputs in one or a few chunks (the per-chunk Python
# overhead would otherwise dominate); the cap keeps each chunk cache-friendly and bounded even
# for huge batches. Measured by benchmarks/credit_speed.py; see docs/parts/signals.md.
_CHUNK_FRACTION = 32  # one chunk buffer <= logits bytes / 32 (two buffers: <= 1/16)
_CHUNK_MIN_BYTES = 4 << 20
_CHUNK_MAX_BYTES = 64 << 20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16/bfloat16 exp-sums over a 50k vocabulary lose too many bits
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk used when ``chunk_size`` is None (see the module constants)."""
    row_bytes = vocab * torch.empty((), dtype=_compute_dtype(dtype)).element_size()
    logits_bytes = n_rows * vocab * torch.empty((), dtype=dtype).element_size()
    budget = min(max(logits_bytes // _CHUNK_FRACTION, _CHUNK_MIN_BYTES), _CHUNK_MAX_BYTES)
    return max(1, min(n_rows, budget // max(row_bytes, 1)))


def _floor(cdt: torch.dtype) -> float:
    # below 2 log(tiny) exp() is exactly 0 in this dtype (subnormals included), so flooring d
    # there changes no probability, yet keeps d, log p and p * log p finite for -inf logits
    return 2.0 * math.log(torch.finfo(cdt).tiny)


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:200]


def _validate(logits, tokens, temperature, chunk_size, want) -> Tuple[str, ...]:
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise CreditInputError(f"logits: expected a tensor of shape [B, T, V], got {_describe(logits)}")
    if not logits.is_floating_point():
        raise CreditInputError(f"logits: expected a floating-point tensor, got dtype {logits.dtype}")
    B, T, V = logits.shape
    if V < 1:
        raise CreditInputError(f"logits: expected a vocabulary of at least 1 entry (V >= 1), got V = {V}")
    if not isinstance(tokens, Tensor) or tuple(tokens.shape) != (B, T):
        raise CreditInputError(f"tokens: expected a tensor of shape ({B}, {T}), got {_describe(tokens)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise CreditInputError(f"tokens: expected an integer tensor, got dtype {tokens.dtype}")
    if tokens.device != logits.device:
        raise CreditInputError(f"tokens: expected device {logits.device} (as logits), got {tokens.device}")
    if tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise CreditInputError(f"tokens: expected ids in [0, {V - 1}] (V = {V}), got {bad}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise CreditInputError(f"temperature: expected a real number > 0, got {_describe(temperature)}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0):
        raise CreditInputError(f"temperature: expected a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1
    ):
        raise CreditInputError(f"chunk_size: expected None or an integer >= 1, got {chunk_size!r}")
    if isinstance(want, str):
        want = (want,)
    want = tuple(want)
    unknown = [w for w in want if w not in SIGNAL_NAMES]
    if not want or unknown:
        raise CreditInputError(
            f"want: expected a non-empty subset of {SIGNAL_NAMES}, got {want!r}"
            + (f" (unknown: {unknown})" if unknown else "")
        )
    # keep the caller's order, drop repeats
    return tuple(dict.fromkeys(want))


def _row_chunks(logits: Tensor, tokens: Tensor, rows: int) -> Iterator[Tuple[int, int, Tensor, Tensor]]:
    """``(r0, r1, x [r, V], y [r])`` over the flattened B*T rows without copying the whole tensor."""
    B, T, V = logits.shape
    N = B * T
    y_flat = tokens.reshape(N)
    try:
        flat: Optional[Tensor] = logits.view(N, V)
    except RuntimeError:
        # e.g. a [:, P-1:-1] slice of a model's output: flattening would copy it all, so each
        # chunk's rows are gathered instead (a chunk-sized copy)
        flat = None
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        if flat is not None:
            x = flat[r0:r1]
        else:
            idx = torch.arange(r0, r1, device=logits.device)
            x = logits[idx // T, idx % T]
        yield r0, r1, x, y_flat[r0:r1]


def _shifted(x: Tensor, cdt: torch.dtype, inv_tau: float, with_argmax: bool):
    """``d = x / tau - max`` as a fresh buffer (in ``cdt``), its row max and optionally the argmax."""
    if x.dtype != cdt:
        z = x.to(cdt)
        if inv_tau != 1.0:
            z.mul_(inv_tau)
    elif inv_tau != 1.0:
        z = x * inv_tau
    else:
        z = None  # x itself; never written to
    src = x if z is None else z
    if with_argmax:
        m, arg = src.max(dim=-1, keepdim=True)
    else:
        m, arg = src.amax(dim=-1, keepdim=True), None
    d = torch.sub(src, m) if z is None else z.sub_(m)
    return d, m, arg


def _forward_chunk(x: Tensor, y: Tensor, cdt: torch.dtype, inv_tau: float, want_h: bool, with_argmax: bool,
                   want_sq: bool = False):
    """Row statistics of one chunk: (log s, d_y, H or None, argmax or None, sum_v exp(2 d_v) or None)."""
    d, _, arg = _shifted(x, cdt, inv_tau, with_argmax)
    d_y = d.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    # -inf logits: a finite floor makes exp() exactly 0 and 0 * d exactly 0 (not NaN)
    d.clamp_(min=_floor(cdt))
    e = d.exp()
    s = e.sum(-1)
    log_s = s.log()
    # sum_v e_v^2 as a row-wise dot product (no chunk-sized temporary), before e is overwritten
    sq = (e.unsqueeze(-2) @ e.unsqueeze(-1)).reshape(-1) if want_sq else None
    H = None
    if want_h:
        H = (log_s - e.mul_(d).sum(-1) / s).clamp_(min=0.0)
    return log_s, d_y, H, (None if arg is None else arg.squeeze(-1)), sq


def _compute(logits: Tensor, tokens: Tensor, inv_tau: float, rows: int, want: Tuple[str, ...], save_argmax: bool):
    """All wanted signals as flat [N] tensors, plus the row statistics backward needs."""
    B, T, V = logits.shape
    N = B * T
    cdt = _compute_dtype(logits.dtype)
    dev = logits.device
    log_s = torch.empty(N, dtype=cdt, device=dev)
    d_y = torch.empty(N, dtype=cdt, device=dev)
    want_h = "entropy" in want
    H = torch.empty(N, dtype=cdt, device=dev) if want_h else None
    arg = torch.empty(N, dtype=torch.long, device=dev) if save_argmax else None
    want_sq = "sum_pi_squared" in want
    sq = torch.empty(N, dtype=cdt, device=dev) if want_sq else None
    for r0, r1, x, y in _row_chunks(logits, tokens, rows):
        ls, dy, h, a, q = _forward_chunk(x, y, cdt, inv_tau, want_h, save_argmax, want_sq)
        log_s[r0:r1] = ls
        d_y[r0:r1] = dy
        if want_h:
            H[r0:r1] = h
        if save_argmax:
            arg[r0:r1] = a
        if want_sq:
            sq[r0:r1] = q
    out = {}
    for name in want:
        if name == "logprobs":
            out[name] = d_y - log_s
        elif name == "entropy":
            out[name] = H
        elif name == "mode_prob":
            out[name] = torch.exp(-log_s)  # 1 / s
        else:
            out[name] = sq * torch.exp(-2.0 * log_s)  # sum e^2 / s^2
    return out, log_s, H, arg


class _FusedSignals(torch.autograd.Function):
    """Chunked signals whose backward recomputes the softmax per chunk (O(N) saved state)."""

    @staticmethod
    def forward(ctx, logits, tokens, inv_tau, rows, want):
        save_argmax = "mode_prob" in want
        out, log_s, H, arg = _compute(logits, tokens, inv_tau, rows, want, save_argmax)
        ctx.inv_tau, ctx.rows, ctx.want = inv_tau, rows, want
        ctx.shape = logits.shape
        # the max is recomputed in backward (cheap next to exp) rather than saved
        ctx.save_for_backward(logits, tokens, log_s, H, arg, out.get("sum_pi_squared"))
        ctx.set_materialize_grads(False)
        return tuple(out[w] for w in want)

    @staticmethod
    def backward(ctx, *grads):
        logits, tokens, log_s, H, arg, S = ctx.saved_tensors
        want = ctx.want
        g = dict(zip(want, grads))
        g_l, g_h, g_m, g_q = g.get("logprobs"), g.get("entropy"), g.get("mode_prob"), g.get("sum_pi_squared")
        if g_l is None and g_h is None and g_m is None and g_q is None:
            return None, None, None, None, None
        cdt = _compute_dtype(logits.dtype)
        B, T, V = ctx.shape
        N = B * T
        inv_tau = ctx.inv_tau
        grad = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(N, V)
        for r0, r1, x, y in _row_chunks(logits, tokens, ctx.rows):
            d, _, _ = _shifted(x, cdt, inv_tau, False)
            d.clamp_(min=_floor(cdt))
            logp = d.sub_(log_s[r0:r1].unsqueeze(-1))  # log p, in place of d
            p = logp.exp()
            # coef_r multiplies -p_v: g_l + g_h (log p_v + H) + g_m p* + 2 g_q S
            coef = torch.zeros(r1 - r0, 1, dtype=cdt, device=logits.device)
            sq_term = None
            if g_q is not None:
                gq = g_q[r0:r1].unsqueeze(-1)
                coef += 2.0 * gq * S[r0:r1].unsqueeze(-1)
                sq_term = p.square().mul_(2.0 * gq)  # + 2 g_q p_v^2, taken before p is overwritten
            if g_l is not None:
                coef += g_l[r0:r1].unsqueeze(-1)
            if g_m is not None:
                pstar = torch.exp(-log_s[r0:r1])
                coef += (g_m[r0:r1] * pstar).unsqueeze(-1)
            if g_h is not None:
                gh = g_h[r0:r1].unsqueeze(-1)
                logp.add_(H[r0:r1].unsqueeze(-1)).mul_(gh).add_(coef)  # g_h (log p + H) + coef
                gz = p.mul_(logp).neg_()
            else:
                gz = p.mul_(coef).neg_()
            if g_l is not None:
                gz.scatter_add_(-1, y.unsqueeze(-1), g_l[r0:r1].unsqueeze(-1))
            if g_m is not None:
                gz.scatter_add_(-1, arg[r0:r1].unsqueeze(-1), (g_m[r0:r1] * pstar).unsqueeze(-1))
            if sq_term is not None:
                gz.add_(sq_term)
            if inv_tau != 1.0:
                gz.mul_(inv_tau)
            grad_flat[r0:r1] = gz
        return grad, None, None, None, None


def token_signals(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    want: Iterable[str] = SIGNAL_NAMES,
) -> Dict[str, Tensor]:
    """Per-token signals of the temperature-scaled next-token distribution.

    Args:
        logits: ``[B, T, V]`` logits whose row ``[b, t]`` is the distribution of ``tokens[b, t]``.
        tokens: ``[B, T]`` integer token ids in ``[0, V)`` (padding must hold a valid id too).
        temperature: ``tau > 0``; the distribution is ``softmax(logits / tau)``.
        chunk_size: rows (of the flattened ``B*T``) per chunk; None picks one so that a chunk's
            temporaries stay near 1/16 of the logits' memory (see :func:`default_chunk_rows`).
        want: any of ``"logprobs"``, ``"entropy"``, ``"mode_prob"``, ``"sum_pi_squared"``.

    Returns:
        ``{name: [B, T]}`` for each wanted signal. With grad enabled and ``logits.requires_grad``
        the outputs are differentiable (custom backward, memory bounded by one chunk plus the
        gradient itself); otherwise no graph is built.
    """
    want = _validate(logits, tokens, temperature, chunk_size, want)
    B, T, V = logits.shape
    N = B * T
    cdt = _compute_dtype(logits.dtype)
    if N == 0:
        return {w: logits.new_empty((B, T), dtype=cdt) for w in want}
    rows = int(chunk_size) if chunk_size is not None else default_chunk_rows(N, V, logits.dtype)
    rows = min(rows, N)
    inv_tau = 1.0 / float(temperature)
    if torch.is_grad_enabled() and logits.requires_grad:
        outs = _FusedSignals.apply(logits, tokens, inv_tau, rows, want)
        return {w: o.view(B, T) for w, o in zip(want, outs)}
    with torch.no_grad():
        out, _, _, _ = _compute(logits, tokens, inv_tau, rows, want, False)
    return {w: o.view(B, T) for w, o in out.items()}


def hidden_residual(h_adapted: Tensor, h_base: Tensor) -> Tensor:
    """ARCA salience ``||h_adapted - h_base||_2`` over the hidden dimension: ``[B, T, D] -> [B, T]``.

    Half-precision inputs are reduced in float32 (the difference of two close bf16 states is
    itself only a few bits wide; the sum of squares over D should not lose more).
    """
    if not isinstance(h_adapted, Tensor) or h_adapted.dim() != 3:
        raise CreditInputError(f"h_adapted: expected a tensor of shape [B, T, D], got {_describe(h_adapted)}")
    if not isinstance(h_base, Tensor) or tuple(h_base.shape) != tuple(h_adapted.shape):
        raise CreditInputError(
            f"h_base: expected a tensor of shape {tuple(h_adapted.shape)} (as h_adapted), got {_describe(h_base)}"
        )
    for name, h in (("h_adapted", h_adapted), ("h_base", h_base)):
        if not h.is_floating_point():
            raise CreditInputError(f"{name}: expected a floating-point tensor, got dtype {h.dtype}")
    cdt = _compute_dtype(torch.promote_types(h_adapted.dtype, h_base.dtype))
    return torch.linalg.vector_norm(h_adapted.to(cdt) - h_base.to(cdt), dim=-1)
