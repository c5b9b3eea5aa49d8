"""Exact values V(h) of the current policy on an enumerable response space.

A task may declare a :class:`ResponseSpace`: every response is exactly ``length`` tokens over a
small ``alphabet`` of one-token characters, and the policy gives every other token probability
0 (the policies of ``tokencredit bench`` carry a frozen -1e4 logit bias there, so the sampled
distribution and the enumerated one are the same). The value of every prefix h_t of a response,

    V(h_t) = sum_{y in alphabet} pi(y | h_t) V(h_t y),        V(h_length) = R(h_length),

is then a finite sum over ``A^(length - t)`` continuations (A = the alphabet's size). One
teacher-forced forward over the ``A^(length-1)`` sequences of ``length - 1`` alphabet tokens
(plus one dummy last token) gives the next-token distribution at every internal node of the
tree (each node is a prefix of some sequence; row ``t`` of a sequence's logits is the
distribution after its first ``t`` tokens), and V is summed bottom-up, level by level, as
tensors. The true credit of token t is ``c_t = V(h_{t+1}) - V(h_t)``
(:mod:`tokencredit.credit.methods.oracle`).

The distribution is the sampling policy's: ``softmax(logits / temperature)`` over the full
vocabulary, with the mass outside the alphabet checked to be at most ``tol`` (else
:class:`ExactValueError`: the values would be those of another policy). The leaves' rewards
come from ``leaf_rewards(group, leaves)``, which the trainer computes with the task's own reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..errors import ExactValueError  # noqa: F401 (defined in errors; importable here too)

__all__ = [
    "ResponseSpace",
    "ExactValueError",
    "MAX_SEQUENCES",
    "alphabet_ids",
    "enumerate_sequences",
    "node_logprobs",
    "tree_values",
    "batch_true_values",
    "prompt_values",
]

#: the most sequences (A^(length-1)) one prompt's enumeration may forward
MAX_SEQUENCES = 4096
#: the most probability the policy may put outside the alphabet for V to count as exact
DEFAULT_TOL = 1e-6


@dataclass(frozen=True)
class ResponseSpace:
    """Responses of exactly ``length`` tokens, each one character of ``alphabet``."""

    alphabet: str
    length: int

    def __post_init__(self):
        if not isinstance(self.alphabet, str) or len(self.alphabet) < 2 or len(set(self.alphabet)) != len(self.alphabet):
            raise ExactValueError(f"response space alphabet: expected >= 2 distinct characters, got {self.alphabet!r}")
        if not isinstance(self.length, int) or self.length < 1:
            raise ExactValueError(f"response space length: expected an int >= 1, got {self.length!r}")
        if self.n_sequences > MAX_SEQUENCES:
            raise ExactValueError(
                f"response space: expected at most {MAX_SEQUENCES} sequences to enumerate (alphabet^(length-1)), "
                f"got {len(self.alphabet)}^{self.length - 1} = {self.n_sequences}"
            )

    @property
    def n_sequences(self) -> int:
        return len(self.alphabet) ** (self.length - 1)

    @property
    def n_leaves(self) -> int:
        return len(self.alphabet) ** self.length


def alphabet_ids(tokenizer, space: ResponseSpace) -> List[int]:
    """The token id of each character of the alphabet (each must be exactly one token)."""
    ids = []
    for ch in space.alphabet:
        tok = tokenizer(ch, add_special_tokens=False)["input_ids"]
        if len(tok) != 1:
            raise ExactValueError(f"response space alphabet: expected {ch!r} to be one token, got {len(tok)} ({tok})")
        ids.append(int(tok[0]))
    return ids


def enumerate_sequences(A: int, n: int) -> torch.Tensor:
    """``[A^n, n]`` alphabet indices of every sequence of ``n`` symbols, in base-A order (row j is
    j written in base A, most significant symbol first)."""
    j = torch.arange(A ** n)
    powers = A ** torch.arange(n - 1, -1, -1)
    return (j.unsqueeze(1) // powers) % A


def _default_forward(model, ids, att, prompt_len, *, hidden=False):
    from .forward import forward_response

    return forward_response(model, ids, att, prompt_len, hidden=hidden)


@torch.no_grad()
def node_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, ids: Sequence[int], length: int, *,
                  temperature: float, forward: Callable = _default_forward, chunk: int = 1024,
                  tol: float = DEFAULT_TOL) -> List[List[torch.Tensor]]:
    """For each prompt (rows of the left-padded ``prompt_ids [U, P]``), the log-probs over the
    alphabet ``ids`` at every node: ``out[u][d]`` is ``[A^d, A]`` (float64), row ``j`` the node
    whose d symbols are j in base A. Raises :class:`ExactValueError` when the policy puts more than
    ``tol`` of its probability outside the alphabet at some node."""
    if not temperature > 0:
        raise ExactValueError(f"temperature: expected > 0 (a sampling policy), got {temperature}")
    A = len(ids)
    idx = torch.tensor(list(ids), device=prompt_ids.device)
    seqs = enumerate_sequences(A, length - 1).to(prompt_ids.device)
    resp = torch.cat([idx[seqs], idx[:1].expand(seqs.shape[0], 1)], dim=1)  # + a dummy last token
    N, U, P = resp.shape[0], prompt_ids.shape[0], prompt_ids.shape[1]
    rows = []  # [U * N, length, A]
    for s in range(0, U * N, chunk):
        r = torch.arange(s, min(s + chunk, U * N), device=prompt_ids.device)
        u, j = r // N, r % N
        inp = torch.cat([prompt_ids[u], resp[j]], dim=1)
        att = torch.cat([prompt_mask[u], torch.ones_like(resp[j])], dim=1)
        _, logits = forward(model, inp, att, P)
        lp = torch.log_softmax(logits.double() / temperature, dim=-1)
        inside = lp[..., idx].exp().sum(-1)
        worst = float((1.0 - inside).max())
        if worst > tol:
            raise ExactValueError(
                f"policy: expected probability <= {tol:g} outside the response alphabet {len(ids)} tokens (an enumerable "
                f"policy, as tokencredit bench builds), got {worst:.3g}"
            )
        rows.append(torch.log_softmax(lp[..., idx], dim=-1))
    lp = torch.cat(rows).view(U, N, length, A)
    out = []
    for u in range(U):
        levels = []
        for d in range(length):
            stride = A ** (length - 1 - d)
            levels.append(lp[u, torch.arange(A ** d, device=lp.device) * stride, d].cpu())
        out.append(levels)
    return out


def tree_values(levels: Sequence[torch.Tensor], leaf_rewards: torch.Tensor) -> List[torch.Tensor]:
    """``V[d]`` ``[A^d]`` for d = 0..length from the nodes' log-probs ``levels[d] [A^d, A]`` and the
    leaves' rewards ``[A^length]`` (base-A order): ``V[length] = R``, ``V[d] = sum_a pi(a) V[d+1]``."""
    A = levels[0].shape[-1]
    V = [leaf_rewards.double()]
    for d in range(len(levels) - 1, -1, -1):
        V.append((levels[d].exp() * V[-1].view(A ** d, A)).sum(-1))
    return V[::-1]


def batch_true_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                      response_ids: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor,
                      ids: Sequence[int], length: int, leaf_rewards: Callable[[int, torch.Tensor], torch.Tensor], *,
                      temperature: float, forward: Callable = _default_forward, chunk: int = 1024,
                      tol: float = DEFAULT_TOL) -> torch.Tensor:
    """``[B, T]`` V(h_t) of every response position of a batch (float32, 0 on padding): one tree
    per group (``group_ids``: rows with one prompt), ``leaf_rewards(row, leaves [A^length, length] token ids)
    -> [A^length]`` scoring the leaves of the prompt of ``row``."""
    B, T = response_ids.shape
    if T != length or not bool(response_mask.bool().all()):
        lens = sorted(set(response_mask.long().sum(-1).tolist()))
        raise ExactValueError(f"responses: expected every response to have exactly {length} tokens (the task's response "
                              f"space), got lengths {lens[:5]}")
    A = len(ids)
    lookup = {int(t): i for i, t in enumerate(ids)}
    sym = response_ids.cpu().tolist()
    bad = [t for row in sym for t in row if t not in lookup]
    if bad:
        raise ExactValueError(f"responses: expected tokens of the response alphabet {list(ids)}, got token {bad[0]}")
    first: Dict[int, int] = {}
    for b, g in enumerate(group_ids.tolist()):
        first.setdefault(int(g), b)
    groups = list(first)
    rows = torch.tensor([first[g] for g in groups], device=input_ids.device)
    levels = node_logprobs(model, input_ids[rows, :prompt_len], attention_mask[rows, :prompt_len], ids, length,
                           temperature=temperature, forward=forward, chunk=chunk, tol=tol)
    leaves = torch.tensor(list(ids))[enumerate_sequences(A, length)]
    values = {g: tree_values(levels[k], leaf_rewards(first[g], leaves)) for k, g in enumerate(groups)}
    out = torch.zeros(B, T, dtype=torch.float32)
    for b, g in enumerate(group_ids.tolist()):
        V = values[int(g)]
        node = 0
        for t in range(T):
            out[b, t] = float(V[t][node])
            node = node * A + lookup[sym[b][t]]
    return out.to(response_ids.device)


def prompt_values(model, tokenizer, examples: Sequence, space: ResponseSpace, reward: Callable[[str, object], float], *,
                  temperature: float, forward: Callable = _default_forward, tol: float = DEFAULT_TOL,
                  cache: Optional[Dict] = None) -> torch.Tensor:
    """``[len(examples)]`` V(h_0) of each example's prompt: the policy's exact success
    probability (expected reward) on it. ``examples`` have chat ``messages``; ``reward(text,
    example)`` scores a decoded leaf; ``cache`` (a dict) keeps the leaves' rewards between calls."""
    ids = alphabet_ids(tokenizer, space)
    texts = [tokenizer.apply_chat_template(list(e.messages), tokenize=False, add_generation_prompt=True) for e in examples]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    dev = next(model.parameters()).device
    levels = node_logprobs(model, enc["input_ids"].to(dev), enc["attention_mask"].to(dev), ids, space.length,
                           temperature=temperature, forward=forward, tol=tol)
    leaves = torch.tensor(ids)[enumerate_sequences(len(ids), space.length)]
    out = []
    for k, ex in enumerate(examples):
        r = leaf_rewards_of(tokenizer, ex, leaves, reward, cache)
        out.append(tree_values(levels[k], r)[0][0])
    return torch.stack(out)


def leaf_rewards_of(tokenizer, example, leaves: torch.Tensor, reward: Callable[[str, object], float],
                    cache: Optional[Dict] = None) -> torch.Tensor:
    """``[N]`` rewards of the decoded ``leaves [N, length]`` for ``example`` (memoised in ``cache``
    under the example's id: a leaf's reward does not change during a run)."""
    key = (getattr(example, "id", None), getattr(example, "answer", None), leaves.shape[1])
    if cache is not None and key in cache:
        return cache[key]
    r = torch.tensor([float(reward(tokenizer.decode(row, skip_special_tokens=True), example)) for row in leaves.tolist()],
                     dtype=torch.float64)
    if cache is not None:
        cache[key] = r
    return r
