"""Credit fidelity: every method's token credit scored against ground-truth credit.

PACT's axioms give the true credit of token t under the current policy,
``c_t = V(h_{t+1}) - V(h_t)``, where ``V(h)`` is the probability that the policy, continuing
from prefix ``h`` (the prompt and the first t response tokens), succeeds; after the last token
``V := R``. This module

1. **estimates V by Monte Carlo** (:func:`build_estimates`): from every response position
   (or every ``stride``-th one: credit is then compared per span of ``stride`` tokens), ``M``
   continuations are sampled from the policy that produced the rollouts, at the rollout
   temperature and within the rollout's token budget, and scored by the task's reward (with its
   timeout). The continuations of one prefix share that prefix's KV cache
   (:func:`tokencredit.forward.prompt_cache`, as rollouts share a prompt) and several prefixes
   are batched. The reward of every continuation is kept (``samples [B, T, M]``, NaN where not
   estimated yet), so standard errors, split halves and bootstraps need nothing else; the file is
   rewritten after every batch, and a rerun resumes where it stopped.
2. **scores** (:func:`score`) every registered method and a few compositions, replayed on the
   estimates' batch exactly as ``tokencredit inspect`` replays
   (:func:`tokencredit.inspector.replay`), per trajectory and then averaged, with a bootstrap
   interval that resamples prompt groups (:func:`trajectory_metrics` defines the four
   metrics). The split-half rows (the estimate from half the continuations against the other
   half, on all trajectories and on the groups with mixed outcomes) show what Monte Carlo noise
   alone does; :func:`spearman_brown` turns them into the rank correlation perfect credit would
   reach against the full estimate.

The estimates file is one ``torch.save`` of tensors and plain values (read back with
``weights_only=True``): the rollouts as the trainer saved them, their fingerprint, the
settings, the policy's description and the samples. ``tokencredit fidelity`` with no argument
scores the bundled reference set (``tokencredit/data/fidelity_reference.pt``, built by
``scripts/build_fidelity_set.py``; docs/fidelity.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .fidelity_base import FORMAT, FidelityError, _atomic_save, _lengths, batch_fingerprint, response_rows  # noqa: F401 (re-exported)

__all__ = [
    "CLAIM_SPECS",
    "FORMAT",
    "FidelityConfig",
    "FidelityError",
    "REFERENCE_SET",
    "REFERENCE_TOKENS",
    "batch_fingerprint",
    "attach_critic",
    "build_estimates",
    "check_policy",
    "critic_values",
    "claims",
    "credit_spans",
    "format_claims",
    "load_estimates",
    "main",
    "sample_batch",
    "sample_continuations",
    "score",
    "span_values",
    "trajectory_metrics",
]

REFERENCE_SET = Path(__file__).parent / "data" / "fidelity_reference.pt"
#: the same batch, V at every position (credit per token) for the first groups of responses
REFERENCE_TOKENS = Path(__file__).parent / "data" / "fidelity_reference_tokens.pt"


@dataclass
class FidelityConfig:
    """Settings of the scores (not of the estimates)."""

    # pivotal mass: share of |A| on the top 10% positions (tokens, or spans with stride > 1;
    # at least one) by |c| (issue 10)
    top_frac: float = 0.1
    # contamination: positive credit on positions whose true credit is below -delta. With M = 16
    # the standard error of one c is about 0.1 on the reference set (up to 0.18 at V = 0.5):
    # delta = 0.1 counts positions about one standard error below 0, not certain harm
    delta: float = 0.1
    n_boot: int = 1000  # bootstrap resamples of the prompt groups
    level: float = 0.95  # two-sided bootstrap interval
    seed: int = 0  # bootstrap and the random-credit row

    def __post_init__(self):
        if not 0 < self.top_frac <= 1:
            raise FidelityError(f"top_frac: expected in (0, 1], got {self.top_frac}")
        if not self.delta >= 0:
            raise FidelityError(f"delta: expected >= 0, got {self.delta}")
        if int(self.n_boot) != self.n_boot or self.n_boot < 1:
            raise FidelityError(f"n_boot: expected an integer >= 1, got {self.n_boot}")
        if not 0 < self.level < 1:
            raise FidelityError(f"level: expected in (0, 1), got {self.level}")


# ---------------------------------------------------------------------------------------
# Monte Carlo continuations (the batch's rows and fingerprint: fidelity_base)


def sample_continuations(model, tokenizer, prefixes: Sequence[Sequence[int]], M: int, budgets: Sequence[int], *,
                         temperature: float, top_p: float = 1.0, share: bool = True,
                         crn_keys: Optional[Sequence[Tuple[int, int]]] = None, crn_seed: int = 0) -> Tuple[List[List[List[int]]], int]:
    """``M`` continuations of every prefix (token ids), each cut at its first stop token
    (kept) and at its own ``budgets[i]`` new tokens. Returns ``(conts, n_generated)`` with
    ``conts[i][m]`` a list of ids and ``n_generated`` the continuation tokens kept.

    With ``share`` each distinct prefix but its last token runs once and its KV cache is
    indexed out to its M rows (what :class:`~tokencredit.rollout.HFRollout` does for prompts);
    without it ``generate`` prefills every row itself (the baseline of the throughput figure).
    Sampling uses the global torch RNG, or with ``crn_keys`` (the ``(row, position)`` of each
    prefix) common random numbers shared by the continuations of neighbouring prefixes
    (:mod:`tokencredit.fidelity_crn`)."""
    from transformers import GenerationConfig

    from .forward import prompt_cache
    from .rollout import HFRollout, _finite_check_processor, response_mask_from_ids

    if M < 1 or len(prefixes) == 0:
        raise FidelityError(f"M: expected >= 1 continuations of >= 1 prefix, got M={M}, {len(prefixes)} prefixes")
    ro = HFRollout(model, tokenizer)
    stop_ids = ro._stop_ids()
    pad = int(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    U = len(prefixes)
    L = max(len(p) for p in prefixes)
    ids = torch.full((U, L), pad, dtype=torch.long)
    att = torch.zeros((U, L), dtype=torch.long)
    for i, p in enumerate(prefixes):
        ids[i, L - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        att[i, L - len(p):] = 1
    inverse = torch.arange(U).repeat_interleave(M)
    processors = [_finite_check_processor()]
    if crn_keys is not None:
        from .fidelity_crn import CRNProcessor, check_keys, crn_rows

        check_keys(crn_keys, U)
        processors.append(CRNProcessor(crn_rows(crn_keys, M), L, seed=crn_seed, temperature=temperature, top_p=top_p))
    greedy = temperature == 0 or crn_keys is not None  # CRN: argmax of the Gumbel-perturbed logits
    sampling = {} if greedy else {"temperature": float(temperature), "top_p": float(top_p), "top_k": 0}
    gen_cfg = GenerationConfig(max_new_tokens=int(max(budgets)), do_sample=not greedy, **sampling,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids, pad_token_id=pad)
    rows_ids, rows_att = ids[inverse].to(device), att[inverse].to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), ro._clean_generation_config(stop_ids):
            extra = {}
            if share and L >= 2:
                _, cache = prompt_cache(model, ids[:, : L - 1].to(device), att[:, : L - 1].to(device),
                                        torch.arange(U, device=device), inverse.to(device))
                extra["past_key_values"] = cache
            out = model.generate(input_ids=rows_ids, attention_mask=rows_att, generation_config=gen_cfg,
                                 logits_processor=processors, **extra)
    finally:
        model.train(was_training)
    new = out[:, L:].cpu() if torch.is_tensor(out) else out.sequences[:, L:].cpu()
    keep = response_mask_from_ids(new, stop_ids).bool() if new.shape[1] else torch.zeros_like(new, dtype=torch.bool)
    conts: List[List[List[int]]] = []
    n_gen = 0
    for i in range(U):
        row = []
        for m in range(M):
            r = i * M + m
            toks = new[r][keep[r]].tolist()[: int(budgets[i])]
            n_gen += len(toks)
            row.append(toks)
        conts.append(row)
    return conts, n_gen


def mc_positions(length: int, stride: int) -> List[int]:
    """Positions whose V is estimated: 0, stride, 2*stride, ... below ``length``."""
    return list(range(0, max(int(length), 1), int(stride)))


def check_policy(model, tokenizer, saved: Dict[str, Any], temperature: float, *, tol: float = 0.05) -> float:
    """Refuse a model that did not produce the batch: its log-probs of the saved responses
    (teacher-forced, at ``temperature``) must match the behaviour log-probs saved with them
    (mean absolute difference <= ``tol`` nats). Returns that difference."""
    from .forward import forward_response
    from .signals import token_signals

    sig = saved["signals"]
    behaviour = sig.get("old_logprobs") if sig.get("old_logprobs") is not None else sig.get("logprobs")
    if behaviour is None:
        return float("nan")
    rows = response_rows(saved)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    top = max((max(r) for r in rows if r), default=0)
    if vocab and top >= vocab:
        raise FidelityError(f"ROLLOUTS: the batch is from another model: token id {top} >= this model's vocabulary size {vocab}")
    diffs = []
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for s0, ids, att, P, rs in _batch_inputs(saved, tokenizer, 16):
                _, logits = forward_response(model, ids.to(device), att.to(device), P)
                lp = token_signals(logits, ids[:, P:].to(device), temperature=temperature if temperature > 0 else 1.0,
                                   want=("logprobs",))["logprobs"].cpu()
                for i, r in enumerate(rs):
                    diffs.append((lp[i, : len(r)] - torch.as_tensor(behaviour)[s0 + i, : len(r)].float()).abs())
    finally:
        model.train(was)
    d = float(torch.cat(diffs).mean()) if diffs else 0.0
    if not d <= tol:
        raise FidelityError(f"ROLLOUTS: the batch was not sampled from this model: mean |log-prob - saved behaviour log-prob| "
                            f"= {d:.3f} nats > {tol} (another model, adapter or temperature?)")
    return d


def _batch_inputs(saved: Dict[str, Any], tokenizer, chunk: int):
    """The saved batch as model inputs, ``chunk`` rows at a time: yields ``(first row, input_ids,
    attention_mask, P, response rows)`` with left-padded prompts of width P, then the responses."""
    rows = response_rows(saved)
    prompts = _prompt_rows(saved, tokenizer)
    pad = int(tokenizer.pad_token_id)
    for s in range(0, len(rows), chunk):
        ps, rs = prompts[s: s + chunk], rows[s: s + chunk]
        P, T = max(len(p) for p in ps), max(max(len(r) for r in rs), 1)
        ids = torch.full((len(ps), P + T), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, (p, r) in enumerate(zip(ps, rs)):
            ids[i, P - len(p): P] = torch.as_tensor(p)
            att[i, P - len(p): P] = 1
            ids[i, P: P + len(r)] = torch.as_tensor(r, dtype=torch.long)
            att[i, P: P + len(r)] = 1
        yield s, ids, att, P, rs


@torch.no_grad()
def critic_values(model, head, tokenizer, saved: Dict[str, Any], *, sigmoid: bool, chunk: int = 16) -> torch.Tensor:
    """``[B, T+1]`` values of a critic (``head``, a value head on ``model``'s final hidden states,
    as the trainer's critic) on the saved batch's states: the state before every response token
    and after the last one, as ``CreditBatch.values``; 0 beyond a response's end. ``sigmoid`` for
    a critic whose values are probabilities (PACT's)."""
    from .forward import forward_response
    from .models import values_from_hidden

    rows = response_rows(saved)
    T = int(torch.as_tensor(saved["signals"]["response_mask"]).shape[1])
    out = torch.zeros(len(rows), T + 1)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        for s0, ids, att, P, rs in _batch_inputs(saved, tokenizer, chunk):
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
    B = len(_lengths(est["rollouts"]))
    T = int(torch.as_tensor(est["rollouts"]["signals"]["response_mask"]).shape[1])
    v = torch.as_tensor(values).float()
    if tuple(v.shape) != (B, T + 1) or not torch.isfinite(v).all():
        raise FidelityError(f"values: expected finite [{B}, {T + 1}] for the batch, got {tuple(v.shape)}")
    return dict(est, critics={**(est.get("critics") or {}), method: {"values": v, "source": str(source)}})


def _prompt_rows(saved: Dict[str, Any], tokenizer) -> List[List[int]]:
    """Prompt token ids per row: saved ``prompt_ids`` if present, else the chat template of the
    saved messages (or questions), as :class:`~tokencredit.rollout.HFRollout` builds them."""
    if saved.get("prompt_ids") is not None:
        ids, mask = torch.as_tensor(saved["prompt_ids"]), torch.as_tensor(saved["prompt_mask"]).bool()
        return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]
    msgs = saved.get("messages")
    if msgs is None:
        qs = saved.get("questions")
        if qs is None:
            raise FidelityError("ROLLOUTS: neither 'prompt_ids', 'messages' nor 'questions': cannot rebuild the prompts")
        msgs = [[{"role": "user", "content": str(q)}] for q in qs]
    out = []
    for m in msgs:
        text = tokenizer.apply_chat_template(list(m), tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def build_estimates(saved: Dict[str, Any], model, tokenizer, reward: Callable[[str, int], Tuple[float, Optional[str]]], out: str | Path, *,
                    M: int = 16, stride: int = 1, temperature: float, top_p: float = 1.0, max_new_tokens: int,
                    rows_per_batch: int = 128, seed: int = 0, policy: str = "", progress: bool = True,
                    check: bool = True, baseline_batches: int = 0, max_seconds: Optional[float] = None,
                    rows: Optional[Sequence[int]] = None,
                    sampler: Optional[Callable[..., Tuple[List[List[List[int]]], int]]] = None,
                    crn: bool = False) -> Dict[str, Any]:
    """Estimate ``V(h_t)`` at every ``stride``-th position of every response; write ``out``.

    ``reward(text, row) -> (reward, failure or None)`` scores the full response text of row
    ``row`` (e.g. :func:`tokencredit.tasks.score_safely` of the task's reward, with its
    timeout). An existing ``out`` of the same batch and settings is resumed; one of another
    batch or other settings is refused. ``baseline_batches`` > 0 also times plain ``generate``
    (no shared prefix) on the first that many batches' prefixes, for the throughput figure.
    ``max_seconds`` stops (resumably) after that long. ``rows``: estimate only these responses
    (e.g. the groups with mixed outcomes; the others stay NaN, and a later build with more rows
    extends the same file). ``sampler(prefixes, M, budgets)`` replaces
    :func:`sample_continuations` (a policy that is not a transformers model; tests); ``model`` is
    then unused; with ``crn`` it is called with ``keys=[(row, position), ...]`` of its prefixes.
    ``crn``: common random numbers for the continuations of neighbouring prefixes
    (:mod:`tokencredit.fidelity_crn`; a setting of the file). Returns the file's content."""
    from .inspector import check_rollouts

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
    chosen = _check_rows(rows, len(_lengths(saved)))
    rows = response_rows(saved)
    B = len(rows)
    T = max([len(r) for r in rows] + [1])
    if out.exists():
        state = load_estimates(out, require_complete=False)
        if state["fingerprint"] != fp:
            raise FidelityError(f"ESTIMATES: {out} was built for another batch (fingerprint {state['fingerprint']}, this batch {fp})")
        if state["settings"] != settings:
            diff = {k: (state["settings"].get(k), v) for k, v in settings.items() if state["settings"].get(k) != v}
            raise FidelityError(f"ESTIMATES: {out} was built with other settings (file, now): {diff}")
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
    prompts = _prompt_rows(saved, tokenizer)
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
            _atomic_save({k: v for k, v in state.items()}, out)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{tok_run / max(sec_run, 1e-9):.0f}")
            if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
                break
    finally:
        bar.close()
        if not out.exists():
            _atomic_save(state, out)
    return state


# ---------------------------------------------------------------------------------------
# loading


def load_estimates(path: str | Path, *, require_complete: bool = True) -> Dict[str, Any]:
    """An estimates file (``weights_only=True``), checked; one-line :class:`FidelityError` otherwise."""
    from .inspector import check_rollouts

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
    B, T = len(_lengths(d["rollouts"])), max(_lengths(d["rollouts"]) + [1])
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
    lengths = _lengths(est["rollouts"])
    stride = int(est["settings"]["stride"])
    s = est["samples"]
    return torch.tensor([bool(not torch.isnan(s[b, mc_positions(n, stride)]).any()) for b, n in enumerate(lengths)])


# ---------------------------------------------------------------------------------------
# true credit


def span_values(est: Dict[str, Any], which: str = "all") -> List[torch.Tensor]:
    """Per row: V at the span boundaries ``[V(h_p0), V(h_p1), ..., V(h_L) = R]`` (float64),
    from all continuations (``"all"``) or the even / odd halves (``"even"`` / ``"odd"``)."""
    lengths = _lengths(est["rollouts"])
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
    lengths = _lengths(est["rollouts"])
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
    for b, (v, n) in enumerate(zip(span_values(est), _lengths(est["rollouts"]))):
        if not done[b]:
            continue
        c = credit_spans(v)
        for j, p in enumerate(mc_positions(n, stride)):
            e = min(p + stride, n)
            out[b, p:e] = float(c[j]) / (e - p)
    return out


# ---------------------------------------------------------------------------------------
# metrics


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n with ties given their average rank."""
    n = x.numel()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    xs = x[order]
    i = 0
    while i < n:
        j = i
        while j + 1 < n and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: torch.Tensor, c: torch.Tensor) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    if a.numel() < 3:
        return float("nan")
    ra, rc = _ranks(a.double()), _ranks(c.double())
    ra, rc = ra - ra.mean(), rc - rc.mean()
    den = math.sqrt(float((ra * ra).sum()) * float((rc * rc).sum()))
    return float((ra * rc).sum()) / den if den > 0 else float("nan")


METRICS = ("pivotal_mass", "sign_agreement", "rank_corr", "contamination")


def top_weights(x: torch.Tensor, k: int) -> torch.Tensor:
    """Membership of each position in the top ``k`` by ``x``, ties at the cut shared: positions
    above the k-th largest value get 1, those equal to it share the remaining places equally
    (so the weights sum to ``k`` and no tie is broken by position)."""
    x = torch.as_tensor(x).double()
    k = min(int(k), x.numel())
    if k <= 0:
        return torch.zeros_like(x)
    v = torch.sort(x, descending=True).values[k - 1]
    above, at = x > v, x == v
    return above.double() + at.double() * (k - int(above.sum())) / int(at.sum())


def trajectory_metrics(a: torch.Tensor, c: torch.Tensor, success: bool, cfg: FidelityConfig = FidelityConfig()) -> Dict[str, float]:
    """The four metrics of one trajectory's credit ``a`` against true credit ``c`` (per token
    or per span; NaN where undefined):

    - ``pivotal_mass``: the share of ``sum |a|`` on the top ``ceil(top_frac * n)`` positions by
      ``|c|``, ties at the cut shared (:func:`top_weights`); undefined when ``c`` is 0 everywhere
      (nothing is pivotal) or ``a`` is (uniform credit: about ``top_frac``);
    - ``sign_agreement``: ``sum |c| * [sign a == sign c] / sum |c|``, a zero ``a`` counting half;
      undefined when ``a`` or ``c`` is 0 everywhere (a method that gives no credit is not scored);
    - ``rank_corr``: Spearman correlation of ``a`` with ``c`` (undefined when either is constant);
    - ``contamination`` (successful responses only; TACO's failure mode): the share of positive
      credit ``sum a+`` given to positions with ``c < -delta``.
    """
    a, c = torch.as_tensor(a).double(), torch.as_tensor(c).double()
    n = a.numel()
    out = {k: float("nan") for k in METRICS}
    if n == 0:
        return out
    w = c.abs()
    sa = float(a.abs().sum())
    if sa > 0 and float(w.sum()) > 0:
        k = max(1, math.ceil(cfg.top_frac * n - 1e-9))
        out["pivotal_mass"] = float((a.abs() * top_weights(w, k)).sum()) / sa
        out["sign_agreement"] = float((w * (torch.sign(a) * torch.sign(c) + 1) / 2).sum() / w.sum())
    out["rank_corr"] = spearman(a, c)
    if success:
        pos = a.clamp_min(0)
        if float(pos.sum()) > 0:
            out["contamination"] = float((pos * (c < -cfg.delta)).sum() / pos.sum())
    return out


def bootstrap_mean(values: Sequence[float], cfg: FidelityConfig = FidelityConfig(),
                   clusters: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """Mean over trajectories (NaN skipped) with a percentile bootstrap interval. With
    ``clusters`` (the prompt group of each value) whole groups are resampled: the responses to
    one prompt are not independent, and resampling them one by one would narrow the interval."""
    keep = [i for i, x in enumerate(values) if not math.isnan(x)]
    v = torch.tensor([values[i] for i in keep], dtype=torch.float64)
    if v.numel() == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0, "groups": 0}
    cl = torch.tensor([int(clusters[i]) for i in keep]) if clusters is not None else torch.arange(v.numel())
    _, cid = torch.unique(cl, return_inverse=True)
    G = int(cid.max()) + 1
    sums = torch.zeros(G, dtype=torch.float64).index_add_(0, cid, v)
    counts = torch.zeros(G, dtype=torch.float64).index_add_(0, cid, torch.ones_like(v))
    g = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randint(0, G, (cfg.n_boot, G), generator=g)
    means = sums[idx].sum(1) / counts[idx].sum(1)
    q = torch.tensor([(1 - cfg.level) / 2, 1 - (1 - cfg.level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means, q).tolist()
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n": int(v.numel()), "groups": G}


def is_constant(adv_row: torch.Tensor, length: int) -> bool:
    """Whether a method's token credit is the same on every token of the response (uniform
    credit: GRPO, RLOO, ...). Its span sums still differ when the last span is shorter than the
    stride, which would give uniform credit a rank correlation with c that is only span length;
    :func:`score` reports it as undefined instead."""
    a = torch.as_tensor(adv_row).double()[:length]
    return bool(a.numel() == 0 or float(a.max() - a.min()) <= 1e-9 * max(1.0, float(a.abs().max())))


def _row_scores(pairs: Sequence[Tuple], cfg: FidelityConfig, clusters: Optional[Sequence[int]] = None) -> Dict[str, Dict[str, float]]:
    """``pairs``: (a, c, success) or (a, c, success, constant); a constant credit has no rank.
    ``clusters``: the prompt group of each pair (the bootstrap resamples groups)."""
    per = []
    for p in pairs:
        m = trajectory_metrics(p[0], p[1], p[2], cfg)
        if len(p) > 3 and p[3]:
            m["rank_corr"] = float("nan")
        per.append(m)
    return {k: bootstrap_mean([p[k] for p in per], cfg, clusters) for k in METRICS}


def _scored_rows(est: Dict[str, Any]) -> Tuple[List[int], int, List[int], List[bool]]:
    """Response lengths, the stride, the complete non-empty rows (what is scored) and, per row,
    whether it succeeded (reward 1)."""
    lengths = _lengths(est["rollouts"])
    done = complete_rows(est)
    rows = [b for b in range(len(lengths)) if done[b] and lengths[b] > 0]
    if not rows:
        raise FidelityError("ESTIMATES: no complete trajectory to score")
    R = torch.as_tensor(est["rollouts"]["signals"]["rewards"]).double()
    return lengths, int(est["settings"]["stride"]), rows, [bool(r >= 1.0 - 1e-6) for r in R.tolist()]


def _mixed_groups(saved: Dict[str, Any], rows: Sequence[int]) -> List[int]:
    """The rows whose prompt group has both outcomes (where group-relative credit is not 0)."""
    R = torch.as_tensor(saved["signals"]["rewards"]).double()
    g = torch.as_tensor(saved["signals"]["group_ids"])
    return [b for b in rows if bool((R[g == g[b]] != R[b]).any())]


def spearman_brown(r_half: float) -> float:
    """The expected correlation of perfect credit with the M-continuation estimate, from the
    correlation ``r_half`` of two independent M/2 estimates (split-half): the M estimate's
    reliability is ``2 r / (1 + r)`` (Spearman-Brown) and a perfect method correlates with it as
    the square root of that. NaN for r <= 0."""
    if not r_half > 0:
        return float("nan")
    return math.sqrt(2 * r_half / (1 + r_half))


def score(est: Dict[str, Any], specs: Optional[Sequence[str]] = None, *, credit_args: Sequence[str] = (),
          cfg: FidelityConfig = FidelityConfig()) -> Dict[str, Any]:
    """Score every replayed method (``specs`` default: what ``inspect`` replays) against the
    true credit of the complete trajectories of ``est``. Returns a JSON-able dict: ``rows``
    (one per method, plus ``true credit`` against itself, ``split-half`` on all trajectories and
    on the groups with mixed outcomes (the noise references), and ``random``), ``skipped``, the
    expected rank correlation of perfect credit (``perfect_rank_corr``) and the set's description.
    Intervals resample prompt groups."""
    from .inspector import replay

    saved = est["rollouts"]
    lengths, stride, rows_idx, success = _scored_rows(est)
    groups = torch.as_tensor(saved["signals"]["group_ids"]).tolist()
    mixed = _mixed_groups(saved, rows_idx)
    V = span_values(est)
    c = {b: credit_spans(V[b]) for b in rows_idx}
    Ve, Vo = span_values(est, "even"), span_values(est, "odd")
    insp = replay(saved, specs, credit_args=credit_args)
    critic_note = None
    if saved["signals"].get("values") is not None:
        critic_note = f"critic of the {saved.get('credit', '?')} run (step {saved.get('step', '?')}), saved with its rollouts"
    views = _with_own_critics(est, insp.views, credit_args)
    out_rows = []

    def add(label, kind, pairs, rows, note=None):
        out_rows.append({"method": label, "kind": kind, "note": note, **_row_scores(pairs, cfg, [groups[b] for b in rows])})

    half = est["samples"].shape[-1] // 2
    add("true credit (MC)", "reference", [(c[b], c[b], success[b]) for b in rows_idx], rows_idx, "c against itself")
    for label, rows in (("split-half", rows_idx), ("split-half, mixed groups", mixed)):
        add(label, "reference", [(credit_spans(Ve[b]), credit_spans(Vo[b]), success[b]) for b in rows], rows,
            f"M/2 = {half} vs the other M/2" + (": the groups where group-relative credit is not 0" if rows is mixed else ""))
    g = torch.Generator().manual_seed(cfg.seed)
    add("random", "reference", [(span_sums(torch.randn(lengths[b], generator=g, dtype=torch.float64), lengths[b], stride), c[b], success[b])
                                for b in rows_idx], rows_idx, "i.i.d. normal credit")
    for v, note in views:
        add(v.label, v.source, [(span_sums(v.advantages[b], lengths[b], stride), c[b], success[b],
                                 is_constant(v.advantages[b], lengths[b])) for b in rows_idx], rows_idx,
            note if note is not None else (critic_note if _critic_method(v.spec) else None))
    se = torch.cat([s for b, s in enumerate(standard_errors(est)) if b in set(rows_idx)])
    cs = torch.cat([c[b] for b in rows_idx])
    ref = {r["method"]: r for r in out_rows}
    return {
        "policy": est.get("policy", ""),
        "settings": est["settings"],
        "trajectories": len(rows_idx),
        "batch_size": len(lengths),
        "groups": len({groups[b] for b in rows_idx}),
        "mixed_trajectories": len(mixed),
        "successful": int(sum(success[b] for b in rows_idx)),
        "positions": int(cs.numel()),
        "mean_len": float(sum(lengths[b] for b in rows_idx) / len(rows_idx)),
        "v_se_mean": float(se.mean()),
        "c_abs_mean": float(cs.abs().mean()),
        "c_neg_frac": float((cs < -cfg.delta).double().mean()),
        "perfect_rank_corr": {k: spearman_brown(ref[f"split-half{s}"]["rank_corr"]["mean"])
                              for k, s in (("all", ""), ("mixed", ", mixed groups"))},
        "config": asdict(cfg),
        "build": {k: v for k, v in (est.get("build") or {}).items()},
        "rows": out_rows,
        "skipped": [{"spec": s.spec, "missing": s.missing, "error": s.error} for s in insp.skipped],
    }


# ---------------------------------------------------------------------------------------
# the papers' token-level claims


#: the methods whose |A| placement :func:`claims` reports (when the batch can replay them)
CLAIM_SPECS = ("grpo", "oppo", "grpo+taco", "grpo+stare", "grpo+acpo", "grpo+arca", "pact",
               "grpo+entropy", "grpo+surprisal", "grpo+divergence")


def _critic_method(spec: str) -> Optional[str]:
    """The method of ``spec`` that declares a critic (its estimator: gae, pact), or None."""
    from .spec import parse_spec

    try:
        methods = parse_spec(spec)
    except (KeyError, ValueError):  # a saved run's own label that is not a spec ("run")
        return None
    return next((m.name for m in methods if m.critic is not None), None)


def _with_own_critics(est: Dict[str, Any], views, credit_args: Sequence[str]):
    """``(view, note)`` per replayed view: a spec whose critic method has a critic of its own in
    ``est["critics"]`` (:func:`attach_critic`) is replayed again on those values; the others keep
    the batch's own (note None)."""
    from .inspector import replay

    critics = est.get("critics") or {}
    out = []
    for v in views:
        m = _critic_method(v.spec) if v.source == "replayed" else None
        if m in critics:
            saved = dict(est["rollouts"], signals=dict(est["rollouts"]["signals"], values=critics[m]["values"]))
            again = replay(saved, [v.spec], credit_args=credit_args, include_saved=False).views
            if again:
                out.append((again[0], critics[m]["source"]))
                continue
        out.append((v, None))
    return out


def _line_of(tokens: Sequence[str], length: int, p: int) -> str:
    """Which line of the response the span starting at token ``p`` opens in ("line k", or "last
    line"): a task-agnostic location (on ``chain``: step 1, step 2, the answer line)."""
    n = "".join(tokens[:length]).rstrip("\n").count("\n") + 1
    k = min("".join(tokens[:p]).count("\n") + 1, n)
    return "last line" if k == n else f"line {k}"


def claims(est: Dict[str, Any], specs: Sequence[str] = CLAIM_SPECS, *, credit_args: Sequence[str] = (),
           cfg: FidelityConfig = FidelityConfig()) -> Dict[str, Any]:
    """The numbers behind docs/fidelity.md's answers to the papers' token-level claims, over the
    complete trajectories of ``est`` whose true credit is not 0 everywhere (JSON-able). Where
    several spans tie for the largest |c| they share the place (:func:`top_weights`).

    * ``sparsity`` (PACT): per response, the share of ``sum |c|`` on its largest / first / last
      span, and the largest span's share for noise alone, ``(c_even - c_odd) / 2`` (the two
      halves' difference: the estimate's noise, no signal); the share of spans with
      ``|c| > 2 delta`` and with ``c < -delta``;
    * ``noise``: mean |c| per span against the standard error of V and of one span's c;
    * ``start_value``: V(h_0) of successful and failed responses (credit owed to the question);
    * ``last_span_c``: the mean true credit of the last span (answer line, end token);
    * ``largest_span_line``: in which line of the response the largest-|c| span opens;
    * ``taco_tail`` (TACO, on the batch's log-probs and entropy; None without them): in
      successful responses, tail tokens at TACO's default alpha, and the true credit of spans
      with and without a token whose surprisal exceeds the entropy (``r_t > log alpha``: TACO's
      risk without its threshold), with intervals that resample prompt groups;
    * ``placement``: per method, the share of its |A| on the span of largest |c| and on the last
      span (where the method puts its credit, against where c is).
    """
    from .inspector import replay
    from .methods.taco import TACOConfig, tail_risk

    saved = est["rollouts"]
    sig = saved["signals"]
    lengths, stride, scored, success = _scored_rows(est)
    groups = torch.as_tensor(sig["group_ids"]).tolist()
    V = span_values(est)
    c = {b: credit_spans(V[b]) for b in scored}
    rows = [b for b in scored if float(c[b].abs().sum()) > 0]  # c = 0 everywhere: nothing to place
    win = {b: success[b] for b in rows}
    Ve, Vo = span_values(est, "even"), span_values(est, "odd")
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
    top1 = {b: top_weights(c[b].abs(), 1) for b in rows}  # the largest-|c| span(s), ties shared

    def share(x, w):
        return float((x.abs() * w).sum() / x.abs().sum())

    noise = []
    for b in rows:
        e = (credit_spans(Ve[b]) - credit_spans(Vo[b])) / 2
        if float(e.abs().sum()) > 0:
            noise.append(float(e.abs().max() / e.abs().sum()))
    cs = torch.cat([c[b] for b in scored])
    se = torch.cat([standard_errors(est)[b] for b in scored])
    lines: Dict[str, float] = {}
    for b in rows:
        pos = mc_positions(lengths[b], stride)
        for j in torch.nonzero(top1[b]).flatten().tolist():
            where = _line_of(saved["tokens"][b], lengths[b], pos[j])
            lines[where] = lines.get(where, 0.0) + float(top1[b][j])

    alpha = TACOConfig().alpha
    taco_tail = None
    if sig.get("logprobs") is not None and sig.get("entropy") is not None:  # what TACO reads
        lp, H = torch.as_tensor(sig["logprobs"]).double(), torch.as_tensor(sig["entropy"]).double()
        risk = {b: tail_risk(lp[b, : lengths[b]], H[b, : lengths[b]], alpha) for b in rows if win[b]}

        def split(threshold):
            out = {True: ([], []), False: ([], [])}  # flagged -> (c values, their groups)
            for b, r in risk.items():
                for j, p in enumerate(mc_positions(lengths[b], stride)):
                    vals, gs = out[bool((r[p: p + stride] > threshold).any())]
                    vals.append(float(c[b][j]))
                    gs.append(groups[b])
            return out

        def spans(vals, gs):
            return {"n": len(vals), "mean_c": bootstrap_mean(vals, cfg, gs),
                    "share_below_minus_delta": mean([float(x < -cfg.delta) for x in vals]),
                    "share_above_delta": mean([float(x > cfg.delta) for x in vals])}

        tail, above = split(0.0), split(math.log(alpha))
        taco_tail = {"alpha": alpha, "tail_tokens": int(sum(int((r > 0).sum()) for r in risk.values())),
                     "surprisal_above_entropy_tokens": int(sum(int((r > math.log(alpha)).sum()) for r in risk.values())),
                     "tokens": int(sum(lengths[b] for b in risk)),
                     "spans_with_tail": spans(*tail[True]), "spans_without_tail": spans(*tail[False]),
                     "spans_surprisal_above_entropy": spans(*above[True]), "spans_other": spans(*above[False])}

    placement = {}
    for v, _ in _with_own_critics(est, replay(saved, list(specs), credit_args=credit_args).views, credit_args):
        if v.spec in placement:
            continue
        top, last = [], []
        for b in rows:
            a = span_sums(v.advantages[b], lengths[b], stride)
            if float(a.abs().sum()) == 0:  # a group without a learning signal (GRPO-family A = 0)
                continue
            top.append(share(a, top1[b]))
            last.append(share(a, torch.nn.functional.one_hot(torch.tensor(a.numel() - 1), a.numel()).double()))
        placement[v.spec] = {"n": len(top), "on_largest_c_span": mean(top), "on_last_span": mean(last)}

    return {
        "trajectories": len(rows),
        "zero_credit_trajectories": len(scored) - len(rows),
        "successful": sum(win.values()),
        "stride": stride,
        "delta": cfg.delta,
        "sparsity": {"spans_per_response": mean([c[b].numel() for b in rows]),
                     "largest_span_share": mean([float(c[b].abs().max() / c[b].abs().sum()) for b in rows]),
                     "largest_span_share_noise_only": mean(noise),
                     "first_span_share": mean([float(c[b][0].abs() / c[b].abs().sum()) for b in rows]),
                     "last_span_share": mean([float(c[b][-1].abs() / c[b].abs().sum()) for b in rows]),
                     "share_abs_c_above_2delta": float((cs.abs() > 2 * cfg.delta).double().mean()),
                     "share_c_below_minus_delta": float((cs < -cfg.delta).double().mean())},
        "noise": {"mean_abs_c": float(cs.abs().mean()), "mean_se_v": float(se.mean()),
                  "se_span_c": math.sqrt(2) * float(se.mean())},
        "start_value": {"all": mean([float(V[b][0]) for b in scored]),
                        "successes": mean([float(V[b][0]) for b in scored if success[b]]),
                        "failures": mean([float(V[b][0]) for b in scored if not success[b]])},
        "last_span_c": {"successes": mean([float(c[b][-1]) for b in scored if success[b]]),
                        "failures": mean([float(c[b][-1]) for b in scored if not success[b]])},
        "largest_span_line": dict(sorted(lines.items(), key=lambda kv: (kv[0] == "last line", kv[0]))),
        "taco_tail": taco_tail,
        "placement": placement,
    }


def format_claims(cl: Dict[str, Any]) -> str:
    sp, no, sv, tt = cl["sparsity"], cl["noise"], cl["start_value"], cl["taco_tail"]
    d, unit = cl["delta"], ("token" if cl["stride"] == 1 else "span")
    out = [
        f"numbers behind the claims ({cl['trajectories']} complete trajectories with some true credit, {cl['successful']} "
        f"successful; {cl['zero_credit_trajectories']} with c = 0 everywhere left out; credit per {unit}; ties share a place)",
        f"  sparsity: {sp['spans_per_response']:.1f} {unit}s per response; share of sum |c| on the largest {sp['largest_span_share']:.2f} "
        f"(noise alone: {sp['largest_span_share_noise_only']:.2f}), first {sp['first_span_share']:.2f}, last {sp['last_span_share']:.2f}; "
        f"{unit}s with |c| > {2 * d:g}: {sp['share_abs_c_above_2delta']:.2f}, with c < -{d:g}: {sp['share_c_below_minus_delta']:.2f}",
        f"  noise: mean |c| {no['mean_abs_c']:.3f}; mean SE of V {no['mean_se_v']:.3f} (SE of one {unit}'s c ~ {no['se_span_c']:.3f})",
        f"  V(h_0): all {sv['all']:.2f}, successes {sv['successes']:.2f}, failures {sv['failures']:.2f}",
        f"  last {unit}'s c: successes {cl['last_span_c']['successes']:.3f}, failures {cl['last_span_c']['failures']:.3f}",
        "  largest-|c| " + unit + " opens in: " + ", ".join(f"{k} {n:.1f}" for k, n in cl["largest_span_line"].items()),
    ]
    if tt is None:
        out.append("  TACO tail tokens: not counted (the batch has no log-probs and entropy)")
    else:
        def sp_(x):
            return (f"n {x['n']}, mean c {_fmt(x['mean_c'])}, share c < -{d:g} {x['share_below_minus_delta']:.2f}, "
                    f"> {d:g} {x['share_above_delta']:.2f}")

        out += [
            f"  TACO tail tokens (alpha {tt['alpha']:g}) in successful responses: {tt['tail_tokens']} of {tt['tokens']}",
            f"  their tokens with surprisal above the entropy: {tt['surprisal_above_entropy_tokens']}; {unit}s with one: "
            f"{sp_(tt['spans_surprisal_above_entropy'])}; other {unit}s: {sp_(tt['spans_other'])}",
        ]
    out.append(f"  where each method's |A| goes (share on the largest-|c| {unit}, on the last {unit}; n = trajectories with A != 0):")
    width = max(len(k) for k in cl["placement"]) + 2 if cl["placement"] else 8
    for spec, pl in cl["placement"].items():
        out.append(f"    {spec.ljust(width)}{pl['on_largest_c_span']:.2f}  {pl['on_last_span']:.2f}  (n {pl['n']})")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# printing and the command


def _fmt(m: Dict[str, float]) -> str:
    if not m["n"]:
        return "–"
    return f"{m['mean']:.3f} [{m['lo']:.2f}, {m['hi']:.2f}]"


def format_table(res: Dict[str, Any]) -> str:
    s = res["settings"]
    unit = "tokens" if s["stride"] == 1 else f"spans of {s['stride']} tokens"
    lines = [
        f"credit fidelity: {res['trajectories']} trajectories"
        + (f" (the complete ones of a batch of {res['batch_size']})" if res.get("batch_size", res["trajectories"]) > res["trajectories"] else "")
        + f" in {res.get('groups', '?')} prompt groups ({res['successful']} successful), {res['positions']} {unit}, "
        f"M = {s['M']} continuations per position, T = {s['temperature']}; mean SE of V = {res['v_se_mean']:.3f}; "
        f"policy: {res['policy'] or '?'}",
        f"metrics per trajectory, averaged, [{int(res['config']['level'] * 100)}% bootstrap over prompt groups]; "
        f"n: trajectories where the method gives credit (A != 0) and c != 0; contamination: positive credit on "
        f"c < -{res['config']['delta']} in successful responses",
        "",
    ]
    head = ("method", "n", "pivotal mass", "sign agreement", "rank corr", "contamination")
    width = max(len(head[0]), *(len(r["method"]) for r in res["rows"])) + 2
    lines.append(head[0].ljust(width) + head[1].rjust(3) + "  " + "".join(h.ljust(22) for h in head[2:]))
    for r in res["rows"]:
        lines.append(r["method"].ljust(width) + str(r["sign_agreement"]["n"]).rjust(3) + "  "
                     + "".join(_fmt(r[k]).ljust(22) for k in METRICS) + (f"  ({r['note']})" if r.get("note") else ""))
    for sk in res["skipped"]:
        why = ("missing " + ", ".join(sk["missing"])) if sk["missing"] else sk["error"]
        lines.append(f"not scored: {sk['spec']} ({why})")
    pr = res.get("perfect_rank_corr") or {}
    if pr:
        lines.append(
            f"rank correlation that perfect credit would reach against this estimate (Spearman-Brown from split-half): "
            f"{pr['all']:.2f} on all trajectories, {pr['mixed']:.2f} on the mixed groups")
    return "\n".join(lines)


def plot_responses(est: Dict[str, Any], path: str | Path, specs: Sequence[str] = ("grpo", "taco", "oppo", "stare", "acpo", "arca"),
                   n: int = 3, credit_args: Sequence[str] = ()) -> Path:
    """A PNG of ``n`` responses (one panel each): the true credit ``c_t`` (per token; per span
    spread evenly) against each method's ``A_t`` scaled to the same max |.|, tokens on the x-axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .inspector import replay

    saved = est["rollouts"]
    lengths = _lengths(saved)
    done = complete_rows(est)
    R = torch.as_tensor(saved["signals"]["rewards"]).float()
    # the complete rows with the largest true-credit range: one success and one failure first
    cands = sorted([b for b in range(len(lengths)) if done[b]], key=lambda b: -float(credit_spans(span_values(est)[b]).abs().max()))
    pick = [next((b for b in cands if R[b] >= 1), None), next((b for b in cands if R[b] < 1), None)]
    pick = [b for b in pick if b is not None]
    pick += [b for b in cands if b not in pick][: max(0, n - len(pick))]
    c = token_credit(est)
    views = [v for v, _ in _with_own_critics(est, replay(saved, list(specs), credit_args=credit_args).views, credit_args)
             if v.source == "replayed"]
    fig, axes = plt.subplots(len(pick), 1, figsize=(14, 3.2 * len(pick)), squeeze=False)
    for ax, b in zip(axes[:, 0], pick):
        L = lengths[b]
        x = torch.arange(L)
        scale = float(c[b, :L].abs().max()) or 1.0
        ax.bar(x, c[b, :L], color="0.75", label="true credit c_t (MC)")
        for v in views:
            a = v.advantages[b, :L].float()
            m = float(a.abs().max()) or 1.0
            ax.plot(x, a / m * scale, marker=".", lw=1, label=f"{v.label} (scaled)")
        ax.axhline(0, color="k", lw=0.5)
        toks = [t.replace("\n", "\\n") for t in saved["tokens"][b]]
        ax.set_xticks(x.tolist())
        ax.set_xticklabels(toks, rotation=90, fontsize=7, family="monospace")
        ax.set_title(f"response {b}: reward {float(R[b]):.0f}, {L} tokens", fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _score_main(argv: List[str]) -> int:
    from .inspector import parse_methods

    p = argparse.ArgumentParser(prog="tokencredit fidelity", description="score every method's token credit against Monte Carlo true credit")
    p.add_argument("file", nargs="?", default=None, help="an estimates file (default: the bundled reference set)")
    p.add_argument("--reference", choices=("spans", "tokens", "exact"), default="spans",
                   help="without FILE, which bundled set: V every 4th position for all 64 responses (spans), at "
                        "every position of the same batch's first groups with mixed outcomes (tokens), or exact V of a "
                        "digit-restricted policy on mul1 (exact)")
    p.add_argument("--methods", default=None, help="comma-separated credit specs (default: what inspect replays)")
    p.add_argument("--credit-args", nargs="*", default=[], metavar="METHOD.FIELD=VALUE")
    p.add_argument("--delta", type=float, default=FidelityConfig.delta)
    p.add_argument("--n-boot", type=int, default=FidelityConfig.n_boot)
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--figure", default=None, help="also write a PNG of a few responses' c_t against each method's A_t")
    p.add_argument("--claims", action="store_true", help="also print the numbers behind docs/fidelity.md's answers to "
                   "the papers' token-level claims (sparsity, TACO's tail tokens, where each method's credit goes)")
    a = p.parse_args(argv)
    try:
        from .fidelity_exact import REFERENCE_EXACT, REFERENCE_EXACT_COMMAND

        ref = {"spans": REFERENCE_SET, "tokens": REFERENCE_TOKENS, "exact": REFERENCE_EXACT}[a.reference]
        if a.file is None and not ref.is_file():
            how = "" if a.reference == "spans" else (" --steps 3 --stride 1 --rows mixed --rollouts-from " + str(REFERENCE_SET)
                                                     + " --work-dir build/fidelity_tokens --output " + str(ref))
            cmd = REFERENCE_EXACT_COMMAND if a.reference == "exact" else f"python scripts/build_fidelity_set.py{how}"
            raise FidelityError(f"no bundled reference set at {ref}: build it with '{cmd}' "
                                "(docs/fidelity.md) or pass an estimates file")
        est = load_estimates(a.file or ref)
        specs = parse_methods(a.methods) if a.methods is not None else None
        cfg = FidelityConfig(delta=a.delta, n_boot=a.n_boot)
        res = score(est, specs, credit_args=tuple(a.credit_args), cfg=cfg)
        if a.claims:
            res["claims"] = claims(est, CLAIM_SPECS if specs is None else specs, credit_args=tuple(a.credit_args), cfg=cfg)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tokencredit fidelity: {e}") from None
    print(json.dumps(res, indent=2, allow_nan=True) if a.json else format_table(res))
    if a.claims and not a.json:
        print("\n" + format_claims(res["claims"]))
    if a.figure:
        print(f"figure written to {plot_responses(est, a.figure)}", file=sys.stderr)
    return 0


def _build_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tokencredit fidelity build",
        description="Monte Carlo V(h_t) for a run's saved rollout batch (from the checkpoint that sampled it), "
                    "or for a batch it samples itself from --model on --task")
    p.add_argument("rollouts", nargs="?", default=None,
                   help="a run directory (its latest eval/rollouts_step_*.pt) or a rollouts file inside one; "
                        "omit it to sample a batch from --model on --task")
    p.add_argument("-o", "--output", required=True, help="the estimates file (resumed when it exists)")
    p.add_argument("--checkpoint", default=None, help="the checkpoint folder of the policy that sampled the batch "
                   "(default: RUN/checkpoints/step_<S-1>, S the rollouts' step)")
    p.add_argument("-M", type=int, default=16, help="continuations per position (even)")
    p.add_argument("--stride", type=int, default=1, help="estimate every k-th position (credit compared per span)")
    p.add_argument("--rows", default=None, help="estimate only these responses (comma-separated indices; default all)")
    p.add_argument("--rows-per-batch", type=int, default=128, help="prefixes x M per generate call (128: docs/fidelity.md)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (resumably) after this long")
    p.add_argument("--crn", action="store_true", help="common random numbers: the continuations of neighbouring prefixes "
                   "share their sampling noise, so V(h_t) and V(h_t+1) are estimated with correlated errors (docs/fidelity.md)")
    p.add_argument("--exact", action="store_true", help="the exact tier (with --task): a batch sampled from the model restricted "
                   "to the digits and its end token, V by enumerating every continuation (docs/fidelity.md)")
    g = p.add_argument_group("sampling a batch (no ROLLOUTS): the trainer's own step at learning rate 0, every signal kept")
    g.add_argument("--model", default=None, help="model name or path (default with --task: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--task", default=None, help="task name (e.g. chain, mul1)")
    g.add_argument("--lora", action="store_true",
                   help="give the model a fresh LoRA adapter (peft's init: B = 0, so the policy is the model's own and "
                        "ARCA's residual and the divergence are 0; for non-trivial ones build from a LoRA run's rollouts)")
    g.add_argument("--prompts", type=int, default=16)
    g.add_argument("--samples", type=int, default=4, help="responses per prompt (the group size)")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.7)
    a = p.parse_args(argv)
    try:
        if (a.rollouts is None) == (a.task is None):
            raise FidelityError(f"ROLLOUTS: expected a run's rollouts or --task (a batch to sample), got "
                                f"{'both' if a.task else 'neither'}")
        if a.rollouts is not None and a.model is not None:
            raise FidelityError("--model: the policy of a run's rollouts is the run's own; expected no --model with ROLLOUTS")
        if a.exact:
            from .fidelity_exact import build_from_task as build_exact

            return build_exact(a)
        return _build_from_run(a) if a.rollouts is not None else _build_from_task(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tokencredit fidelity build: {e}") from None


def _check_rows(rows: Optional[Sequence[int]], B: int) -> List[int]:
    """The responses to estimate: all, or ``rows`` if they are distinct indices of the batch."""
    chosen = list(range(B)) if rows is None else [int(b) for b in rows]
    if len(set(chosen)) != len(chosen) or any(not 0 <= b < B for b in chosen):
        raise FidelityError(f"rows: expected distinct response indices in 0..{B - 1}, got {list(rows)}")
    return chosen


def _parse_rows(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FidelityError(f"--rows: expected comma-separated response indices, got {text!r}") from None


def _run_of(rollouts_file: Path) -> Path:
    return rollouts_file.parent.parent if rollouts_file.parent.name == "eval" else rollouts_file.parent


def _load_run(run: Path, checkpoint: Optional[Path], *, critic: bool = False):
    """A run's config, its model (LoRA as configured) with a checkpoint's weights, the tokenizer
    and, with ``critic``, the checkpoint's value head. ``checkpoint`` None: the initial weights."""
    from .checkpoint import load_checkpoint
    from .config import TrainConfig, _from_dict
    from .models import ValueHead, add_lora, resolve_model

    cfg_file = run / "config.json"
    if not cfg_file.is_file():
        raise FidelityError(f"RUN: {run} is not a run directory with config.json (needed for the model, task and sampling settings)")
    cfg = _from_dict(TrainConfig, json.loads(cfg_file.read_text()), "config.json")
    sd = None
    if checkpoint is not None:
        if not checkpoint.exists():
            raise FidelityError(f"--checkpoint: no checkpoint {checkpoint}")
        sd = load_checkpoint(checkpoint)
    if critic and (sd is None or sd.get("critic") is None):
        raise FidelityError(f"RUN: expected a checkpoint with a critic (a run of gae or pact), got "
                            f"{checkpoint if checkpoint is not None else 'none'} without one")
    model, tok = resolve_model(cfg.model.name, cache_dir=cfg.model.cache_dir)
    if cfg.model.lora:
        model = add_lora(model, r=cfg.model.lora_r, alpha=cfg.model.lora_alpha, target_modules=cfg.model.lora_targets)
    head = None
    if sd is not None:
        _copy_weights(model, sd["model"], f"--checkpoint: {checkpoint}")
        if critic:
            head = ValueHead(int(model.config.hidden_size))
            head.load_state_dict(sd["critic"])
    return cfg, model, tok, head


def _copy_weights(model, weights: Dict[str, torch.Tensor], where: str) -> None:
    """Copy ``weights`` (name -> tensor) into ``model``'s parameters; a name it lacks is an error."""
    params = dict(model.named_parameters())
    extra = sorted(set(weights) - set(params))
    if extra:
        raise FidelityError(f"{where} has weight {extra[0]!r} that this model lacks (another model?)")
    with torch.no_grad():
        for n, v in weights.items():
            params[n].copy_(v)


def _task_examples(cfg, saved: Dict[str, Any]):
    from .tasks import make_task

    task = make_task(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval,
                     path=cfg.task.path, reward_fn=cfg.task.reward_fn)
    by_q = {e.question: e for e in list(task.train) + list(task.eval)}
    qs = saved.get("questions") or []
    missing = [q for q in qs if q not in by_q]
    if missing or len(qs) != len(_lengths(saved)):
        raise FidelityError(f"ROLLOUTS: {len(missing)} question(s) not in task {cfg.task.name!r} (e.g. {missing[:1]!r}): another task?")
    return task, [by_q[q] for q in qs]


def _estimate(a, cfg, model, tok, saved: Dict[str, Any], policy: str) -> int:
    from .tasks import score_safely

    task, exs = _task_examples(cfg, saved)
    saved = dict(saved, messages=[list(e.messages) for e in exs])

    def reward(text, b):
        return score_safely(task.reward, text, exs[b], cfg.task.reward_timeout_s)

    build_estimates(saved, model, tok, reward, a.output, M=a.M, stride=a.stride, temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens, rows_per_batch=a.rows_per_batch,
                    seed=a.seed, policy=policy, rows=_parse_rows(a.rows), crn=a.crn,
                    max_seconds=None if a.max_minutes is None else a.max_minutes * 60)
    print(f"estimates written to {a.output}")
    return 0


def _build_from_run(a) -> int:
    from .inspector import find_rollouts, load_rollouts

    if a.threads:
        torch.set_num_threads(a.threads)
    src = find_rollouts(a.rollouts)
    run = _run_of(src)
    saved = load_rollouts(src)
    _check_rows(_parse_rows(a.rows), len(_lengths(saved)))  # before any model loads
    step = int(saved.get("step") or 0)
    ck = Path(a.checkpoint) if a.checkpoint else run / "checkpoints" / f"step_{step - 1:08d}"
    if (step > 1 or a.checkpoint) and not ck.exists():
        raise FidelityError(f"--checkpoint: the batch of step {step} was sampled by the weights after step {step - 1}; "
                            f"no checkpoint {ck} (pass --checkpoint, or save every step)")
    use = ck if step > 1 or a.checkpoint else None
    cfg, model, tok, _ = _load_run(run, use)
    policy = f"{cfg.model.name}{' + LoRA' if cfg.model.lora else ''} from {use if use is not None else 'the initial weights'}"
    return _estimate(a, cfg, model, tok, saved, policy)


def sample_batch(trainer, prompts: int) -> Dict[str, Any]:
    """One batch of ``prompts`` x the run's samples per prompt from ``trainer``'s policy as it is,
    taken by the trainer's own step with the learning rate set to 0 (the weights are checked to
    be unchanged), so that it carries every signal and the credit state exactly as a run saves
    them. Returns the rollouts (as ``_save_rollouts`` writes them)."""
    import tempfile

    cfg = trainer.cfg
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    kept = (cfg.rollout.prompts_per_step, cfg.log.save_rollouts, cfg.log.eval_every)
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    # a step that saves its rollouts computes every signal the trainer can give (_inspect_plan)
    cfg.rollout.prompts_per_step, cfg.log.save_rollouts, cfg.log.eval_every = int(prompts), True, 1
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
    try:
        trainer.train_step()
    finally:
        cfg.rollout.prompts_per_step, cfg.log.save_rollouts, cfg.log.eval_every = kept
        for g, lr in zip(trainer.optimizer.param_groups, lrs):
            g["lr"] = lr
    trainer.step += 1
    after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    if changed:
        raise RuntimeError(f"sample_batch: a step at learning rate 0 changed {changed[:3]}")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "rollouts.pt"
        trainer._save_rollouts(path)
        return torch.load(path, map_location="cpu", weights_only=True)


def _build_from_task(a) -> int:
    from .config import LogConfig, ModelConfig, OptimConfig, RolloutConfig, TaskConfig, TrainConfig
    from .models import EMBEDDED
    from .trainer import Trainer

    out = Path(a.output)
    if out.exists():  # resume: the batch is the file's own
        est = load_estimates(out, require_complete=False)
        run = out.with_name(out.name + ".run")
        cfg, model, tok, _ = _load_run(run, None)
        if (cfg.model.name, cfg.task.name) != (a.model or EMBEDDED, a.task):
            raise FidelityError(f"ESTIMATES: {out} samples {cfg.model.name} on {cfg.task.name}; expected {a.model or EMBEDDED} on {a.task}")
        if cfg.model.lora:
            _copy_weights(model, torch.load(run / "adapter.pt", map_location="cpu", weights_only=True), f"ESTIMATES: {run / 'adapter.pt'}")
        return _estimate(a, cfg, model, tok, est["rollouts"], est.get("policy", ""))
    cfg = TrainConfig(
        credit="grpo", steps=1, seed=a.seed, threads=a.threads, output_dir=str(out.with_name(out.name + ".run")),
        model=ModelConfig(name=a.model or EMBEDDED, lora=a.lora),
        task=TaskConfig(name=a.task),
        rollout=RolloutConfig(prompts_per_step=a.prompts, samples_per_prompt=a.samples, max_new_tokens=a.max_new_tokens,
                              temperature=a.temperature),
        optim=OptimConfig(micro_batch_size=max(1, a.prompts * a.samples)),
        log=LogConfig(eval_samples=0, eval_at_start=False, progress=False),
    )
    cfg.validate()
    _check_rows(_parse_rows(a.rows), a.prompts * a.samples)  # before any model loads
    trainer = Trainer(cfg)
    trainer._open_logs()  # config.json: a resumed build reloads the same model and task
    saved = sample_batch(trainer, a.prompts)
    if cfg.model.lora:  # a fresh adapter is random: keep it, so that a resumed build samples the same policy
        torch.save({n: p.detach().cpu() for n, p in trainer.model.named_parameters() if "lora_" in n},
                   Path(cfg.output_dir) / "adapter.pt")
    policy = f"{cfg.model.name}{' + fresh LoRA' if cfg.model.lora else ''} (initial weights), batch sampled by fidelity build"
    return _estimate(a, cfg, trainer.model, trainer.tokenizer, saved, policy)


def _critic_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tokencredit fidelity critic",
        description="evaluate the critic of a gae or pact run on an estimates file's batch and store it in the file, so "
                    "that `tokencredit fidelity` scores that method with its own run's critic")
    p.add_argument("estimates", help="the estimates file (updated in place, or written to -o)")
    p.add_argument("run", help="the run directory of a method with a critic (gae, pact)")
    p.add_argument("--checkpoint", default=None, help="default: the run's latest checkpoint")
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    try:
        return _critic_from_run(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tokencredit fidelity critic: {e}") from None


def _critic_from_run(a) -> int:
    from .checkpoint import latest_checkpoint
    from .spec import CreditPipeline

    if a.threads:
        torch.set_num_threads(a.threads)
    est = load_estimates(a.estimates, require_complete=False)
    run = Path(a.run)
    ck = Path(a.checkpoint) if a.checkpoint else latest_checkpoint(run / "checkpoints")
    cfg, model, tok, head = _load_run(run, ck, critic=True)
    pipe = CreditPipeline(cfg.credit, cfg.method_configs())
    method = _critic_method(pipe.name)
    if method is None:
        raise FidelityError(f"RUN: {run} trained {pipe.name!r}, which declares no critic; expected a run of gae or pact")
    from .registry import get_method

    spec = get_method(method).critic(pipe.configs[method])
    saved = est["rollouts"]
    _task_examples(cfg, saved)  # the same task's questions
    values = critic_values(model, head, tok, saved, sigmoid=spec.transform == "sigmoid")
    # how far this run's policy is from the one that sampled the batch (its critic is of that policy)
    diff = check_policy(model, tok, saved, cfg.rollout.temperature, tol=float("inf"))
    m = re.search(r"(\d+)$", ck.name) if ck is not None else None
    step = int(m.group(1)) if m else "?"
    source = (f"critic of a {pipe.name} run ({run.name}, step {step}) evaluated on this batch; that run's policy differs "
              f"from the batch's by {diff:.3f} nats/token")
    est = attach_critic(est, method, values, source)
    out = Path(a.output or a.estimates)
    _atomic_save(est, out)
    print(f"{method}: {source}; written to {out}")
    return 0


def main(argv: Sequence[str]) -> int:
    """``tokencredit fidelity [FILE] [--json] ...``, ``tokencredit fidelity build RUN -o FILE ...`` (or
    ``build --task T -o FILE``) or ``tokencredit fidelity critic FILE RUN``."""
    argv = list(argv)
    if argv and argv[0] == "build":
        return _build_main(argv[1:])
    if argv and argv[0] == "critic":
        return _critic_main(argv[1:])
    return _score_main(argv)
