"""The exact tier of credit fidelity: V(h) by enumeration, with no Monte Carlo noise at all.

A policy restricted to a small vocabulary (the digits and an end token, say) and a short
answer has few enough continuations to enumerate them all. :class:`RestrictedPolicy` is the
model's temperature-scaled softmax renormalised over ``allowed`` token ids; :func:`exact_tree`
expands every continuation of a prompt level by level (one batched forward per level and chunk)
and keeps each node's next-token log-probabilities; :func:`tree_values` gives every node's
``V(h) = sum_y pi_R(y | h) V(h y)``, ``V = R`` at the leaves (an end token, or the token budget).
Every prefix of every response to that prompt is then a node, so the true credit
``c_t = V(h_{t+1}) - V(h_t)`` of every token is exact for this (restricted) policy.

:func:`exact_estimates` samples a batch from the restricted policy itself (so that the credit is
the credit of the policy that produced it), with the per-token signals methods read (log-probs,
entropy and mode probability of the restricted distribution, the token ids, and the oracle
log-probs of the policy on the oracle prompt), and writes a fidelity estimates file whose
``samples`` hold the exact V twice (M = 2): :func:`tokencredit.analysis.fidelity.score` scores it as it
scores a Monte Carlo file, and its split-half reference is exactly 1 (no noise ceiling).
``tokencredit fidelity build --task T --exact`` (:mod:`.cli`) builds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .base import FORMAT, FidelityError, batch_fingerprint

__all__ = ["RestrictedPolicy", "digit_vocabulary", "exact_tree", "tree_values", "exact_estimates"]

Node = Tuple[int, ...]


def _error(msg: str):
    return FidelityError(msg)


def digit_vocabulary(tokenizer, chars: str = "0123456789") -> Tuple[List[int], List[int]]:
    """``(allowed, stop)``: the token id of each character of ``chars`` (each must be one token)
    plus the end token, and the end token alone."""
    allowed = []
    for ch in chars:
        ids = tokenizer(ch, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise _error(f"vocabulary: expected {ch!r} to be one token, got {len(ids)} ({ids})")
        allowed.append(int(ids[0]))
    eos = tokenizer.eos_token_id
    if eos is None:
        raise _error("vocabulary: expected a tokenizer with an end token (eos_token_id), got None")
    return allowed + [int(eos)], [int(eos)]


@dataclass
class RestrictedPolicy:
    """The model's softmax at ``temperature`` renormalised over ``allowed`` ids (which hold ``stop``)."""

    model: Any
    allowed: Sequence[int]
    stop: Sequence[int]
    temperature: float = 1.0
    chunk: int = 64

    def __post_init__(self):
        if not self.temperature > 0:
            raise _error(f"temperature: expected > 0 (a sampling policy), got {self.temperature}")
        if len(set(self.allowed)) != len(self.allowed) or not set(self.stop) <= set(self.allowed) or not self.stop:
            raise _error(f"allowed / stop: expected distinct allowed ids holding every stop id, got {list(self.allowed)} / {list(self.stop)}")

    @torch.no_grad()
    def next_logprobs(self, prompt: Sequence[int], nodes: Sequence[Node]) -> torch.Tensor:
        """``[len(nodes), len(allowed)]`` float64 log pi_R(. | prompt + node); nodes of one length.
        The prompt runs once per chunk and its KV cache is indexed out to the chunk's nodes
        (:func:`tokencredit.engine.forward.prompt_cache`), so only the nodes' own tokens are forwarded."""
        from ...engine.forward import cache_name, prompt_cache

        out = []
        idx = torch.tensor(list(self.allowed))
        p_ids = torch.tensor([list(prompt)], dtype=torch.long)
        p_att = torch.ones_like(p_ids)
        was = self.model.training
        self.model.eval()
        try:
            for s in range(0, len(nodes), self.chunk):
                part = nodes[s: s + self.chunk]
                n, d = len(part), len(part[0])
                po, cache = prompt_cache(self.model, p_ids, p_att, torch.tensor([0]), torch.zeros(n, dtype=torch.long))
                if d == 0:
                    logits = po.logits[:, -1].double().expand(n, -1)
                else:
                    ids = torch.tensor([list(x) for x in part], dtype=torch.long)
                    att = torch.ones((n, p_ids.shape[1] + d), dtype=torch.long)
                    pos = torch.arange(p_ids.shape[1], p_ids.shape[1] + d).expand(n, d)
                    logits = self.model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True,
                                        **{cache_name(self.model): cache}).logits[:, -1].double()
                out.append(torch.log_softmax(logits[:, idx] / self.temperature, -1))
        finally:
            self.model.train(was)
        return torch.cat(out)


def exact_tree(policy: RestrictedPolicy, prompt: Sequence[int], max_new_tokens: int) -> Dict[Node, torch.Tensor]:
    """Every internal node (a continuation that has not ended) -> its next-token log-probs over
    ``policy.allowed``. A child ends at a stop token or at ``max_new_tokens`` tokens."""
    stop = set(policy.stop)
    tree: Dict[Node, torch.Tensor] = {}
    frontier: List[Node] = [()]
    while frontier:
        lp = policy.next_logprobs(prompt, frontier)
        nxt = []
        for node, row in zip(frontier, lp):
            tree[node] = row
            if len(node) + 1 < max_new_tokens:
                nxt += [node + (a,) for a in policy.allowed if a not in stop]
        frontier = nxt
    return tree


def tree_values(tree: Dict[Node, torch.Tensor], allowed: Sequence[int], reward: Callable[[Node], float]) -> Dict[Node, float]:
    """V of every node: ``R`` at a leaf (a node not in ``tree``), ``sum_y pi(y) V(node y)`` inside."""
    V: Dict[Node, float] = {}

    def value(node: Node) -> float:
        if node in V:
            return V[node]
        if node not in tree:
            V[node] = float(reward(node))
        else:
            p = tree[node].exp()
            V[node] = float(sum(float(p[i]) * value(node + (a,)) for i, a in enumerate(allowed)))
        return V[node]

    value(())
    return V


def _sample(tree: Dict[Node, torch.Tensor], allowed: Sequence[int], gen: torch.Generator) -> Node:
    node: Node = ()
    while node in tree:
        i = int(torch.multinomial(tree[node].exp(), 1, generator=gen))
        node = node + (allowed[i],)
    return node


def exact_estimates(model, tokenizer, examples: Sequence[Any], reward: Callable[[str, Any], float], *, samples: int = 4,
                    max_new_tokens: int = 3, temperature: float = 1.0, seed: int = 0,
                    allowed: Optional[Sequence[int]] = None, stop: Optional[Sequence[int]] = None,
                    oracle_prompt: Optional[Callable[[str, str], str]] = None, policy: str = "",
                    oracle: bool = True) -> Dict[str, Any]:
    """A batch of ``samples`` responses to each example, drawn from the restricted policy, with
    exact V at every position; returned as a fidelity estimates dict (``tokencredit.analysis.fidelity``
    format, ``settings["exact"] = True``, M = 2 identical "samples" of the exact V).

    ``examples``: objects with ``messages`` (chat messages), ``question`` and ``answer``;
    ``reward(text, example)`` scores a decoded response. ``oracle_prompt(question, answer)``
    gives the oracle log-probs of the same responses (default: the self-oracle prompt a
    trainer's signal plan uses, :meth:`tokencredit.credit.plan.SignalPlan.with_signals`);
    ``oracle=False`` leaves them out (one forward per token: most of the cost; only methods that
    declare ``oracle_logprobs`` read them, and their replay then refuses the batch). The batch is
    labelled with the trainer's default credit (``TrainConfig.credit``), as a batch that
    ``fidelity build --task`` samples."""
    from ...train.config import TrainConfig
    from ...credit.plan import SignalPlan

    if allowed is None or stop is None:
        allowed, stop = digit_vocabulary(tokenizer)
    pol = RestrictedPolicy(model, list(allowed), list(stop), temperature)
    oracle_prompt = oracle_prompt or SignalPlan.policy_only(hidden=False).with_signals({"oracle_logprobs"}).oracle.prompt
    gen = torch.Generator().manual_seed(int(seed))

    def encode(messages):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows, rewards, groups, prompts, questions, V_rows, lp_rows, orc_rows = [], [], [], [], [], [], [], []
    n_nodes = 0
    for g, ex in enumerate(examples):
        prompt = encode(ex.messages)
        tree = exact_tree(pol, prompt, max_new_tokens)
        n_nodes += len(tree)
        V = tree_values(tree, pol.allowed, lambda node: reward(tokenizer.decode(list(node), skip_special_tokens=True), ex))
        # the oracle sees the same conversation with its last user message replaced (as the trainers' oracle pass)
        msgs = [dict(m) for m in ex.messages]
        last = max(i for i, m in enumerate(msgs) if m.get("role") == "user")
        msgs[last]["content"] = oracle_prompt(ex.question, str(ex.answer))
        oprompt = encode(msgs)
        for _ in range(samples):
            node = _sample(tree, pol.allowed, gen)
            rows.append(list(node))
            rewards.append(V[node])
            groups.append(g)
            prompts.append(prompt)
            questions.append(ex.question)
            V_rows.append([V[node[:t]] for t in range(len(node))])
            lp_rows.append([tree[node[:t]] for t in range(len(node))])
            if oracle:
                orc = [pol.next_logprobs(oprompt, [node[:t]])[0] for t in range(len(node))]
                orc_rows.append([float(o[pol.allowed.index(y)]) for o, y in zip(orc, node)])
    B, T = len(rows), max(len(r) for r in rows)
    P = max(len(p) for p in prompts)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0])
    mask = torch.zeros(B, T, dtype=torch.long)
    ids = torch.full((B, T), pad, dtype=torch.long)
    sig = {k: torch.zeros(B, T) for k in ("logprobs", "entropy", "mode_prob", "sum_pi_squared", "oracle_logprobs")}
    samples_t = torch.full((B, T, 2), float("nan"))
    pids = torch.full((B, P), pad, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.long)
    for b, (row, lps) in enumerate(zip(rows, lp_rows)):
        n = len(row)
        mask[b, :n] = 1
        ids[b, :n] = torch.tensor(row)
        pids[b, P - len(prompts[b]):] = torch.tensor(prompts[b])
        pmask[b, P - len(prompts[b]):] = 1
        for t, (y, lp) in enumerate(zip(row, lps)):
            p = lp.exp()
            sig["logprobs"][b, t] = float(lp[pol.allowed.index(y)])
            sig["entropy"][b, t] = float(-(p * lp).sum())
            sig["mode_prob"][b, t] = float(p.max())
            sig["sum_pi_squared"][b, t] = float((p * p).sum())
            if oracle:
                sig["oracle_logprobs"][b, t] = orc_rows[b][t]
            samples_t[b, t] = V_rows[b][t]
    if not oracle:
        del sig["oracle_logprobs"]
    saved = {
        "credit": TrainConfig.credit,
        "signals": {"response_mask": mask, "rewards": torch.tensor(rewards, dtype=torch.float32),
                    "group_ids": torch.tensor(groups), "old_logprobs": sig["logprobs"].clone(), "token_ids": ids.clone(), **sig},
        "tokens": [[tokenizer.decode([y]) for y in row] for row in rows],
        "response_ids": ids, "questions": questions, "prompt_ids": pids, "prompt_mask": pmask,
    }
    settings = {"M": 2, "stride": 1, "temperature": float(temperature), "top_p": 1.0, "max_new_tokens": int(max_new_tokens),
                "seed": int(seed), "exact": True}
    return {"format": FORMAT, "fingerprint": batch_fingerprint(saved), "settings": settings, "policy": policy,
            "rollouts": saved, "samples": samples_t, "cont_tokens": torch.zeros(B, T, dtype=torch.long),
            "build": {"exact_nodes": n_nodes, "vocabulary": [int(a) for a in pol.allowed]}}
