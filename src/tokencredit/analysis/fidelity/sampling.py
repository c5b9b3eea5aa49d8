"""Sampling from the policy that produced a batch: ``M`` continuations of every prefix
(:func:`sample_continuations`, the prefixes' KV cache shared as rollouts share a prompt, and
optionally common random numbers, :mod:`.crn`), the check that a model is that policy
(:func:`check_policy`), the saved batch as model inputs, and a fresh batch taken by the
trainer's own step at learning rate 0 (:func:`sample_batch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .base import FidelityError, response_rows

__all__ = ["batch_inputs", "check_policy", "prompt_rows", "sample_batch", "sample_continuations"]


def sample_continuations(model, tokenizer, prefixes: Sequence[Sequence[int]], M: int, budgets: Sequence[int], *,
                         temperature: float, top_p: float = 1.0, share: bool = True,
                         crn_keys: Optional[Sequence[Tuple[int, int]]] = None, crn_seed: int = 0) -> Tuple[List[List[List[int]]], int]:
    """``M`` continuations of every prefix (token ids), each cut at its first stop token
    (kept) and at its own ``budgets[i]`` new tokens. Returns ``(conts, n_generated)`` with
    ``conts[i][m]`` a list of ids and ``n_generated`` the continuation tokens kept.

    With ``share`` each distinct prefix but its last token runs once and its KV cache is
    indexed out to its M rows (what :class:`~tokencredit.engine.rollout.HFRollout` does for prompts);
    without it ``generate`` prefills every row itself (the baseline of the throughput figure).
    Sampling uses the global torch RNG, or with ``crn_keys`` (the ``(row, position)`` of each
    prefix) common random numbers shared by the continuations of neighbouring prefixes
    (:mod:`tokencredit.analysis.fidelity.crn`)."""
    from transformers import GenerationConfig

    from ...engine.forward import cache_name, prompt_cache
    from ...engine.rollout import (
        check_tokenizer,
        clean_generation_config,
        finite_check_processor,
        response_mask_from_ids,
        stop_token_ids,
    )

    if M < 1 or len(prefixes) == 0:
        raise FidelityError(f"M: expected >= 1 continuations of >= 1 prefix, got M={M}, {len(prefixes)} prefixes")
    check_tokenizer(tokenizer)
    stop_ids = stop_token_ids(tokenizer, model)
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
    processors = [finite_check_processor()]
    if crn_keys is not None:
        from .crn import CRNProcessor, check_keys, crn_rows

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
        with torch.no_grad(), clean_generation_config(model, tokenizer, stop_ids):
            extra = {}
            if share and L >= 2:
                _, cache = prompt_cache(model, ids[:, : L - 1].to(device), att[:, : L - 1].to(device),
                                        torch.arange(U, device=device), inverse.to(device))
                extra[cache_name(model)] = cache
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


def check_policy(model, tokenizer, saved: Dict[str, Any], temperature: float, *, tol: float = 0.05) -> float:
    """Refuse a model that did not produce the batch: its log-probs of the saved responses
    (teacher-forced, at ``temperature``) must match the behaviour log-probs saved with them
    (mean absolute difference <= ``tol`` nats). Returns that difference."""
    from ...engine.forward import forward_response
    from ...engine.signals import token_signals

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
            for s0, ids, att, P, rs in batch_inputs(saved, tokenizer, 16):
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


def batch_inputs(saved: Dict[str, Any], tokenizer, chunk: int):
    """The saved batch as model inputs, ``chunk`` rows at a time: yields ``(first row, input_ids,
    attention_mask, P, response rows)`` with left-padded prompts of width P, then the responses."""
    rows = response_rows(saved)
    prompts = prompt_rows(saved, tokenizer)
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


def prompt_rows(saved: Dict[str, Any], tokenizer) -> List[List[int]]:
    """Prompt token ids per row: saved ``prompt_ids`` if present, else the chat template of the
    saved messages (or questions), as :class:`~tokencredit.engine.rollout.HFRollout` builds them."""
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


def sample_batch(trainer, prompts: int) -> Dict[str, Any]:
    """One batch of ``prompts`` x the run's samples per prompt from ``trainer``'s policy as it is,
    taken by the trainer's own step with the learning rate set to 0 (the weights are checked to
    be unchanged), so that it carries every signal and the credit state exactly as a run saves
    them. Returns the rollouts (as ``Trainer.save_rollouts`` writes them)."""
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
        trainer.save_rollouts(path)
        return torch.load(path, map_location="cpu", weights_only=True)
