"""The value estimates and their file: ``V(h_t)`` by Monte Carlo (:func:`build_estimates`), the
file read back and checked (:func:`load_estimates`), a critic's values stored in it
(:func:`critic_values`, :func:`attach_critic`), and the true credit ``c_t = V(h_{t+1}) - V(h_t)``
read from it (:func:`span_values`, :func:`credit_spans`, :func:`token_credit`).

The file is one ``torch.save`` of tensors and plain values (read back with
``weights_only=True``): ``format`` (:data:`~.base.FORMAT`), the rollouts as the trainer saved
them, their ``fingerprint``, the ``settings`` (M, stride, temperature, top_p, max_new_tokens,
seed; ``crn`` or ``exact`` when set), the ``policy``'s description, the ``samples [B, T, M]``
(the reward of every continuation, NaN where not estimated yet), ``cont_tokens``, ``build``
(timings, failures, the policy check) and optionally ``critics`` (method -> values, source).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .base import (
    FORMAT,
    EstimatesMismatch,
    FidelityError,
    atomic_save,
    batch_fingerprint,
    check_rows,
    mc_positions,
    response_lengths,
    response_rows,
)
from .sampling import batch_inputs, check_policy, prompt_rows, sample_continuations

__all__ = ["attach_critic", "build_estimates", "complete_rows", "credit_spans", "critic_values", "is_estimates_file",
           "load_estimates", "rollouts_with_true_credit", "span_sums", "span_values", "standard_errors", "token_credit"]


@torch.no_grad()
def critic_values(model, head, tokenizer, saved: Dict[str, Any], *, sigmoid: bool, chunk: int = 16) -> torch.Tensor:
    """``[B, T+1]`` values of a critic (``head``, a value head on ``model``'s final hidden states,
    as the trainer's critic) on the saved batch's states: the state before every response token
    and after the last one, as ``CreditBatch.values``; 0 beyond a response's end. ``sigmoid`` for
    a critic whose values are probabilities (PACT's)."""
    from ...engine.forward import forward_response
    from ...engine.models import values_from_hidden

    rows = response_rows(saved)
    T = int(torch.as_tensor(saved["signals"]["response_mask"]).shape[1])
    out = torch.zeros(len(rows), T + 1)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        for s0, ids, att, P, rs in batch_inputs(saved, tokenizer, chunk):
            h, _ = forward_response(model, ids.to(device), att.to(device), P, hidden=True)
            v = values_from_hidden(head, h, sigmoid=sigmoid).float().cpu()
            for i, r in enumerate(rs):
                out[s0 + i, : len(r) + 1] = v[i, : len(r) + 1]
    finally:
        model.train(was)
    return out


def attach_critic(est: Dict[str, Any], method: str, values: torch.Tensor, source: str) -> Dict[str, Any]:
    """``est`` with ``values`` [B, T+1] as the critic ``method`` (e.g. ``gae``) is scored with
    (``score`` replays specs with that estimator on these values instead of the batch's own)."""
    B = len(response_lengths(est["rollouts"]))
    T = int(torch.as_tensor(est["rollouts"]["signals"]["response_mask"]).shape[1])
    v = torch.as_tensor(values).float()
    if tuple(v.shape) != (B, T + 1) or not torch.isfinite(v).all():
        raise FidelityError(f"values: expected finite [{B}, {T + 1}] for the batch, got {tuple(v.shape)}")
    return dict(est, critics={**(est.get("critics") or {}), method: {"values": v, "source": str(source)}})


def build_estimates(saved: Dict[str, Any], model, tokenizer, reward: Callable[[str, int], Tuple[float, Optional[str]]], out: str | Path, *,
                    M: int = 16, stride: int = 1, temperature: float, top_p: float = 1.0, max_new_tokens: int,
                    rows_per_batch: int = 128, seed: int = 0, policy: str = "", progress: bool = True,
                    check: bool = True, baseline_batches: int = 0, max_seconds: Optional[float] = None,
                    rows: Optional[Sequence[int]] = None,
                    sampler: Optional[Callable[..., Tuple[List[List[List[int]]], int]]] = None,
                    crn: bool = False) -> Dict[str, Any]:
    """Estimate ``V(h_t)`` at every ``stride``-th position of every response; write ``out``.

    ``reward(text, row) -> (reward, failure or None)`` scores the full response text of row
    ``row`` (e.g. :func:`tokencredit.data.tasks.score_safely` of the task's reward, with its
    timeout). An existing ``out`` of the same batch and settings is resumed; one of another
    batch or other settings is refused. ``baseline_batches`` > 0 also times plain ``generate``
    (no shared prefix) on the first that many batches' prefixes, for the throughput figure.
    ``max_seconds`` stops (resumably) after that long. ``rows``: estimate only these responses
    (e.g. the groups with mixed outcomes; the others stay NaN, and a later build with more rows
    extends the same file). ``sampler(prefixes, M, budgets)`` replaces
    :func:`sample_continuations` (a policy that is not a transformers model; tests); ``model`` is
    then unused; with ``crn`` it is called with ``keys=[(row, position), ...]`` of its prefixes.
    ``crn``: common random numbers for the continuations of neighbouring prefixes
    (:mod:`tokencredit.analysis.fidelity.crn`; a setting of the file). Returns the file's content."""
    from ...train.records import check_rollouts

    check_rollouts(saved)
    for name, v, lo in (("M", M, 1), ("stride", stride, 1), ("max_new_tokens", max_new_tokens, 1), ("rows_per_batch", rows_per_batch, 1)):
        if int(v) != v or v < lo:
            raise FidelityError(f"{name}: expected an integer >= {lo}, got {v}")
    if M % 2:
        raise FidelityError(f"M: expected an even number (the split-half reference splits the continuations in halves), got {M}")
    out = Path(out)
    fp = batch_fingerprint(saved)
    settings = {"M": int(M), "stride": int(stride), "temperature": float(temperature), "top_p": float(top_p),
                "max_new_tokens": int(max_new_tokens), "seed": int(seed), **({"crn": True} if crn else {})}
    chosen = check_rows(rows, len(response_lengths(saved)))
    rows = response_rows(saved)
    B = len(rows)
    T = max([len(r) for r in rows] + [1])
    if out.exists():
        state = load_estimates(out, require_complete=False)
        if state["fingerprint"] != fp:
            raise EstimatesMismatch(f"ESTIMATES: {out} was built for another batch (fingerprint {state['fingerprint']}, this batch {fp})")
        if state["settings"] != settings:
            diff = {k: (state["settings"].get(k), v) for k, v in settings.items() if state["settings"].get(k) != v}
            raise EstimatesMismatch(f"ESTIMATES: {out} was built with other settings (file, now): {diff}")
    else:
        if any(len(r) > max_new_tokens for r in rows):
            raise FidelityError(f"max_new_tokens: expected >= the longest response ({max(len(r) for r in rows)}), got {max_new_tokens}")
        state = {"format": FORMAT, "fingerprint": fp, "settings": settings, "policy": policy, "rollouts": saved,
                 "samples": torch.full((B, T, M), float("nan")), "cont_tokens": torch.zeros((B, T), dtype=torch.long),
                 "build": {"seconds": 0.0, "cont_tokens": 0, "baseline": None, "failed": {"error": 0, "timeout": 0}}}
    if sampler is None:
        def sampler(prefixes, M, budgets, share=True, keys=None):
            return sample_continuations(model, tokenizer, prefixes, M, budgets, temperature=temperature, top_p=top_p, share=share,
                                        crn_keys=keys, crn_seed=int(seed))
    draw = (lambda prefixes, M, budgets, keys, share=True: sampler(prefixes, M, budgets, share=share, keys=keys)) if crn else (
        lambda prefixes, M, budgets, keys, share=True: sampler(prefixes, M, budgets, share=share))
    if check:
        state["build"]["policy_logprob_diff"] = check_policy(model, tokenizer, saved, temperature)
    prompts = prompt_rows(saved, tokenizer)
    samples, cont_tokens = state["samples"], state["cont_tokens"]
    # (rank among the chosen rows, row, position) of every position still to estimate
    todo3 = [(k, b, t) for k, b in enumerate(chosen) for t in mc_positions(len(rows[b]), stride) if torch.isnan(samples[b, t]).any()]
    per = max(1, int(rows_per_batch) // M)
    # One generate call runs until its longest continuation ends, so a batch should hold
    # prefixes of one position t (similar budgets) rather than all positions of one response
    # (budgets from the whole response down to a few tokens: ~2x the decode steps). Groups of
    # ``per`` responses at a time, position by position: a build stopped half-way still has
    # complete trajectories (whole groups) to score.
    todo3.sort(key=lambda kbt: (kbt[0] // per, kbt[2], kbt[0]))
    chunks: List[List[Tuple[int, int]]] = []
    key = None
    for k, b, t in todo3:  # one chunk per (group of chosen rows, position): at most ``per`` prefixes
        if chunks and key == (k // per, t):
            chunks[-1].append((b, t))
        else:
            chunks.append([(b, t)])
            key = (k // per, t)
    todo = [bt for ch in chunks for bt in ch]
    total = sum(len(mc_positions(len(rows[b]), stride)) for b in chosen)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=total - len(todo), unit="pos", desc="fidelity build", disable=not progress, smoothing=0.1)
    t_start = time.perf_counter()
    seconds0 = float(state["build"].get("seconds", 0.0))
    tok_run, sec_run = 0, 0.0
    try:
        for ci, chunk in enumerate(chunks):
            prefixes = [prompts[b] + rows[b][:t] for b, t in chunk]
            budgets = [max_new_tokens - t for b, t in chunk]
            b0, t0 = chunk[0]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed) * 1_000_003 + b0 * 4099 + t0)
                t1 = time.perf_counter()
                conts, n_gen = draw(prefixes, M, budgets, chunk)
                dt = time.perf_counter() - t1
            if ci < baseline_batches:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(seed) * 1_000_003 + b0 * 4099 + t0)
                    t2 = time.perf_counter()
                    _, n_plain = draw(prefixes, M, budgets, chunk, share=False)
                    dp = time.perf_counter() - t2
                bl = state["build"].get("baseline") or {"shared_tokens": 0, "shared_s": 0.0, "plain_tokens": 0, "plain_s": 0.0, "batches": 0}
                bl["shared_tokens"] += n_gen
                bl["shared_s"] += dt
                bl["plain_tokens"] += n_plain
                bl["plain_s"] += dp
                bl["batches"] += 1
                state["build"]["baseline"] = bl
            for (b, t), cs in zip(chunk, conts):
                vals = []
                for c in cs:
                    text = tokenizer.decode(rows[b][:t] + c, skip_special_tokens=True)
                    r, why = reward(text, b)
                    if why is not None:
                        state["build"]["failed"][why] = state["build"]["failed"].get(why, 0) + 1
                    vals.append(float(r))
                samples[b, t] = torch.tensor(vals)
                cont_tokens[b, t] = sum(len(c) for c in cs)
            tok_run += n_gen
            sec_run += dt
            state["build"]["seconds"] = seconds0 + time.perf_counter() - t_start
            state["build"]["cont_tokens"] += n_gen
            atomic_save({k: v for k, v in state.items()}, out)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{tok_run / max(sec_run, 1e-9):.0f}")
            if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                break
    finally:
        bar.close()
        if not out.exists():
            atomic_save(state, out)
    return state


def load_estimates(path: str | Path, *, require_complete: bool = True) -> Dict[str, Any]:
    """An estimates file (``weights_only=True``), checked; one-line :class:`FidelityError` otherwise."""
    from ...train.records import check_rollouts

    p = Path(path)
    if not p.is_file():
        raise FidelityError(f"ESTIMATES: no such file {p}")
    try:
        d = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise FidelityError(f"ESTIMATES: {p} is not a tokencredit file readable with weights_only=True ({type(e).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        what = "a rollouts file without credit estimates" if isinstance(d, dict) and "signals" in d else "not a fidelity estimates file"
        raise FidelityError(f"ESTIMATES: {p} is {what} (expected format {FORMAT!r}; build one with 'tokencredit fidelity build')")
    for k in ("fingerprint", "settings", "rollouts", "samples"):
        if k not in d:
            raise FidelityError(f"ESTIMATES: {p} has no {k!r}")
    check_rollouts(d["rollouts"], f"ESTIMATES {p}: rollouts")
    fp = batch_fingerprint(d["rollouts"])
    if fp != d["fingerprint"]:
        raise FidelityError(f"ESTIMATES: {p}: the estimates are of another batch (fingerprint {d['fingerprint']}) than the rollouts it holds ({fp})")
    B, T = len(response_lengths(d["rollouts"])), max(response_lengths(d["rollouts"]) + [1])
    s = d["samples"]
    if not torch.is_tensor(s) or s.dim() != 3 or s.shape[0] != B or s.shape[1] < T:
        raise FidelityError(f"ESTIMATES: {p}: samples expected [B={B}, >={T}, M], got {tuple(s.shape) if torch.is_tensor(s) else type(s).__name__}")
    if require_complete and not complete_rows(d).any():
        raise FidelityError(f"ESTIMATES: {p} has no complete trajectory yet (resume the build)")
    return d


def is_estimates_file(path: str | Path) -> bool:
    """Whether ``path`` is a fidelity estimates file (read with ``weights_only=True``)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        d = torch.load(p, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - not ours, whatever it is
        return False
    return isinstance(d, dict) and d.get("format") == FORMAT


def rollouts_with_true_credit(est: Dict[str, Any]) -> Dict[str, Any]:
    """The rollouts of an estimates file with the Monte Carlo true credit ``c_t`` attached as a
    reference row (``inspect`` shows it above the methods; a span's credit is spread evenly over
    its tokens when the estimates are per span)."""
    st = est["settings"]
    stride = "" if st["stride"] == 1 else f", stride {st['stride']}"
    return dict(est["rollouts"], reference_rows={f"true credit (MC, M={st['M']}{stride})": token_credit(est)})


def complete_rows(est: Dict[str, Any]) -> torch.Tensor:
    """[B] bool: every estimated position of the row has all M samples."""
    lengths = response_lengths(est["rollouts"])
    stride = int(est["settings"]["stride"])
    s = est["samples"]
    return torch.tensor([bool(not torch.isnan(s[b, mc_positions(n, stride)]).any()) for b, n in enumerate(lengths)])


def span_values(est: Dict[str, Any], which: str = "all") -> List[torch.Tensor]:
    """Per row: V at the span boundaries ``[V(h_p0), V(h_p1), ..., V(h_L) = R]`` (float64),
    from all continuations (``"all"``) or the even / odd halves (``"even"`` / ``"odd"``)."""
    lengths = response_lengths(est["rollouts"])
    stride = int(est["settings"]["stride"])
    s = est["samples"].double()
    if which == "even":
        s = s[..., 0::2]
    elif which == "odd":
        s = s[..., 1::2]
    elif which != "all":
        raise FidelityError(f"which: expected all, even or odd, got {which!r}")
    R = torch.as_tensor(est["rollouts"]["signals"]["rewards"]).double()
    return [torch.cat([s[b, mc_positions(n, stride)].mean(-1), R[b: b + 1]]) for b, n in enumerate(lengths)]


def standard_errors(est: Dict[str, Any]) -> List[torch.Tensor]:
    """Per row: the standard error of each estimated ``V(h_p)``. Rewards of 0 / 1 (success):
    the binomial ``sqrt(p (1 - p) / M)`` with the Jeffreys-smoothed ``p = (k + 1/2) / (M + 1)``,
    so that 0 or M successes out of M do not claim an SE of 0; other rewards: the sample std / sqrt(M)."""
    lengths = response_lengths(est["rollouts"])
    stride = int(est["settings"]["stride"])
    s = est["samples"].double()
    M = s.shape[-1]
    out = []
    for b, n in enumerate(lengths):
        x = s[b, mc_positions(n, stride)]
        if bool(((x == 0) | (x == 1) | torch.isnan(x)).all()):
            p = (x.sum(-1) + 0.5) / (M + 1)
            out.append(torch.sqrt(p * (1 - p) / M))
        else:
            out.append(x.std(-1, unbiased=True) / math.sqrt(M))
    return out


def credit_spans(values: torch.Tensor) -> torch.Tensor:
    """``c_j = V_{j+1} - V_j``: the true credit of each span from its boundary values."""
    return values[1:] - values[:-1]


def span_sums(adv_row: torch.Tensor, length: int, stride: int) -> torch.Tensor:
    """A method's credit per span: the sum of its token advantages over the span."""
    a = torch.as_tensor(adv_row).double()[:length]
    return torch.stack([a[p: p + stride].sum() for p in mc_positions(length, stride)])


def token_credit(est: Dict[str, Any]) -> torch.Tensor:
    """``[B, T]`` true credit per token (a span's credit spread evenly over its tokens; exact
    c_t with stride 1); 0 on padding and on rows not yet complete."""
    mask = torch.as_tensor(est["rollouts"]["signals"]["response_mask"]).bool()
    out = torch.zeros(mask.shape, dtype=torch.float32)
    stride = int(est["settings"]["stride"])
    done = complete_rows(est)
    for b, (v, n) in enumerate(zip(span_values(est), response_lengths(est["rollouts"]))):
        if not done[b]:
            continue
        c = credit_spans(v)
        for j, p in enumerate(mc_positions(n, stride)):
            e = min(p + stride, n)
            out[b, p:e] = float(c[j]) / (e - p)
    return out
