"""Run a :class:`~tokencredit.credit.plan.SignalPlan`'s passes for a model and a batch.

One module computes every per-token signal a credit spec declares, for the own trainer and for
``TokenCreditGRPOTrainer`` (and, next, the verl workers): each pass runs once, in micro-batches,
without grad, and serves every signal it can give. The caller supplies the models
(:class:`PassModels`), the inputs (:class:`PassInputs`: left-padded prompts then right-padded
responses, as ``forward.forward_response`` takes them) and, optionally, its own forward
(TRL: autocast, multimodal inputs), its own adapter-off context and signals it already has
(TRL's generation-time log-probs), which are then not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .forward import forward_response
from ..credit.plan import SignalPlan
from ..credit.planning import planning_mask
from .signals import hidden_residual, token_signals

__all__ = ["PassInputs", "PassModels", "run_passes", "oracle_texts", "join_prompts_and_responses", "update_gives"]


@dataclass
class PassInputs:
    input_ids: torch.Tensor  # [N, P + T]
    attention_mask: torch.Tensor
    prompt_len: int  # P
    response_ids: torch.Tensor  # [N, T]
    response_mask: torch.Tensor
    # the oracle pass's own input (oracle-prompted prompts + the same responses), when planned
    oracle_input_ids: Optional[torch.Tensor] = None
    oracle_attention_mask: Optional[torch.Tensor] = None
    oracle_prompt_len: Optional[int] = None
    # one response token's text (a tokenizer's decode of [id]): the planning_mask signal
    decode: Optional[Callable[[List[int]], str]] = None
    # the enumeration pass (true_values): the rows' prompt ids, the response alphabet's token ids
    # and ``leaf_rewards(row, leaves [N, T]) -> [N]``, the rewards of every response to row's prompt
    group_ids: Optional[torch.Tensor] = None
    alphabet: Optional[Sequence[int]] = None
    leaf_rewards: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None
    # the continuation pass (mc_values): ``sample(prefixes, k, budgets)`` draws continuations from
    # the policy (continuations.sample_continuations), ``continuation_rewards(row, responses)``
    # scores whole responses to row's prompt with the task's reward; ``budget``: new tokens per response
    sample: Optional[Callable[[List[List[int]], int, List[int]], List[List[List[int]]]]] = None
    continuation_rewards: Optional[Callable[[int, List[List[int]]], Sequence[float]]] = None
    budget: Optional[int] = None


@dataclass
class PassModels:
    policy: Any
    reference: Any = None
    teacher: Any = None
    critic: Any = None  # a value head on the policy's final hidden states
    # a context in which the policy runs with its adapter off (default: models.adapter_disabled)
    adapter_off: Optional[Callable[[], ContextManager]] = None


Forward = Callable[..., Any]  # (model, ids, att, prompt_len, *, hidden) -> (h [N,T+1,D] | None, logits [N,T,V])


def _default_forward(model, ids, att, prompt_len, *, hidden=False):
    return forward_response(model, ids, att, prompt_len, hidden=hidden)


def update_gives(plan: SignalPlan, ppo_epochs: int) -> Tuple[str, ...]:
    """The signals of ``plan``'s policy pass that the update's own forward can give instead (the
    policy pass is then dropped), or ``()`` when the pass is needed.

    With one epoch nothing changes the weights between the policy pass and the update, so the
    update's forward over the same batch computes the same log-probs, entropy and top-1
    probability (TRL's ``old_per_token_logps = per_token_logps.detach()``). The pass stays when
    the plan keeps its hidden states (a critic, ARCA's residual with its adapter-off pass) or with
    several epochs (later epochs need the pre-update values), or when a continuation pass's cut
    rule reads the log-probs (``ContinuationPass.reads_logprobs``). Passes of another model or input
    (adapter-off, reference, oracle) and a critic's post-update pass are not touched."""
    if ppo_epochs != 1 or not plan.policy or plan.policy_hidden:
        return ()
    if plan.continuations is not None and plan.continuations.reads_logprobs:
        return ()  # the cut rule reads the log-probs before the update runs (SPO's cut points)
    return plan.policy


@torch.no_grad()
def run_passes(
    plan: SignalPlan,
    models: PassModels,
    inp: PassInputs,
    *,
    temperature: float,
    micro_batch_size: int,
    forward: Forward = _default_forward,
    given: Optional[Mapping[str, torch.Tensor]] = None,
    check: Optional[Callable[[torch.Tensor, str, torch.Tensor], None]] = None,
) -> Dict[str, torch.Tensor]:
    """Every signal of ``plan`` (``plan.signals``, plus ``"hidden"`` [N, T+1, D] when the policy
    pass keeps it), each pass run once in chunks of ``micro_batch_size`` rows.

    ``given``: signals the caller already has (not recomputed; a pass all of whose outputs are
    given is skipped). ``check(logits, what, mask)``: called on every pass's logits (the trainer
    stops on non-finite values). The policy runs in eval mode and is restored to its mode.
    """
    given = dict(given or {})
    if plan.oracle is not None and inp.oracle_input_ids is None and "oracle_logprobs" not in given:
        raise ValueError("oracle_input_ids: the plan has an oracle pass; expected its inputs, got None")
    if plan.reference and models.reference is None and "ref_logprobs" not in given:
        raise ValueError("reference: the plan has a reference pass; expected a reference model, got None")
    if plan.oracle is not None and plan.oracle.scorer == "teacher" and models.teacher is None:
        raise ValueError("teacher: the plan's oracle pass is scored by a teacher; expected a teacher model, got None")
    policy_sig = tuple(s for s in plan.policy if s not in given)
    run_policy = bool(policy_sig) or plan.policy_hidden
    off_sig = tuple(x for x in plan.adapter_off if not (x == "logprobs" and "ref_logprobs" in given))
    if "hidden" in off_sig and "hidden_residual" in given:
        off_sig = tuple(x for x in off_sig if x != "hidden")
    run_ref = plan.reference and "ref_logprobs" not in given
    run_oracle = plan.oracle is not None and "oracle_logprobs" not in given
    adapter_off = models.adapter_off
    if adapter_off is None:
        from .models import adapter_disabled

        adapter_off = lambda: adapter_disabled(models.policy)  # noqa: E731

    def lp_of(logits, resp):
        return token_signals(logits, resp, temperature=temperature, want=("logprobs",))["logprobs"]

    out: Dict[str, List[torch.Tensor]] = {}
    N = inp.response_ids.shape[0]
    P = inp.prompt_len
    policy = models.policy
    was_training = policy.training
    policy.eval()
    try:
        for s in range(0, N, micro_batch_size):
            sl = slice(s, s + micro_batch_size)
            ids, att, resp, rmask = inp.input_ids[sl], inp.attention_mask[sl], inp.response_ids[sl], inp.response_mask[sl]
            h = None
            if run_policy:
                h, logits = forward(policy, ids, att, P, hidden=plan.policy_hidden)
                if check is not None:
                    check(logits, "policy logits (signal pass)", rmask)
                want = policy_sig or ("logprobs",)
                for k, v in token_signals(logits, resp, temperature=temperature, want=want).items():
                    if k in policy_sig:
                        out.setdefault(k, []).append(v)
                if plan.policy_hidden:
                    out.setdefault("hidden", []).append(h)
            if off_sig:
                with adapter_off():
                    hb, logits = forward(policy, ids, att, P, hidden="hidden" in off_sig)
                if "logprobs" in off_sig:
                    out.setdefault("ref_logprobs", []).append(lp_of(logits, resp))
                if "hidden" in off_sig:
                    out.setdefault("hidden_residual", []).append(hidden_residual(h[:, :-1], hb[:, :-1]))
            if run_ref:
                _, logits = forward(models.reference, ids, att, P)
                out.setdefault("ref_logprobs", []).append(lp_of(logits, resp))
            if run_oracle:
                scorer = models.teacher if plan.oracle.scorer == "teacher" else policy
                _, logits = forward(scorer, inp.oracle_input_ids[sl], inp.oracle_attention_mask[sl], inp.oracle_prompt_len)
                if check is not None:
                    check(logits, "oracle logits", rmask)
                out.setdefault("oracle_logprobs", []).append(lp_of(logits, resp))
    finally:
        policy.train(was_training)
    res = {k: torch.cat(v) for k, v in out.items()}
    if "token_ids" in plan.signals:  # the rollout's own tokens: no pass
        res["token_ids"] = inp.response_ids
    if "planning_mask" in plan.signals and "planning_mask" not in given:  # the decoded tokens: no pass
        if inp.decode is None:
            raise ValueError("planning_mask: expected PassInputs.decode (the tokenizer's decode) to find the planning tokens, got None")
        res["planning_mask"] = planning_mask(inp.response_ids, inp.response_mask, inp.decode)
    for k, v in given.items():
        if k in plan.signals:
            res.setdefault(k, v)
    if plan.true_values and "true_values" not in given:
        from .exactvalue import batch_true_values

        if inp.alphabet is None or inp.leaf_rewards is None or inp.group_ids is None:
            raise ValueError("true_values: the plan has an enumeration pass; expected PassInputs.group_ids, alphabet and leaf_rewards, got None")
        res["true_values"] = batch_true_values(
            policy, inp.input_ids, inp.attention_mask, P, inp.response_ids, inp.response_mask, inp.group_ids,
            inp.alphabet, inp.response_ids.shape[1], inp.leaf_rewards, temperature=temperature, forward=forward)
    if plan.continuations is not None and "mc_values" not in given:
        from .continuations import mc_step_values

        if inp.sample is None or inp.continuation_rewards is None or inp.budget is None or inp.decode is None:
            raise ValueError("mc_values: the plan has a continuation pass; expected PassInputs.sample, continuation_rewards, "
                             "budget and decode, got None")
        pm = inp.attention_mask[:, :P].bool().cpu()
        rm = inp.response_mask.bool().cpu()
        mc = mc_step_values(plan.continuations, prompts=[inp.input_ids[b, :P].cpu()[pm[b]].tolist() for b in range(N)],
                            responses=[inp.response_ids[b].cpu()[rm[b]].tolist() for b in range(N)], decode=inp.decode,
                            budget=inp.budget, sample=inp.sample, rewards=inp.continuation_rewards,
                            logprobs=res["logprobs"].cpu() if "logprobs" in res else None, T=inp.response_ids.shape[1])
        res.update({k: v.to(inp.response_ids.device) for k, v in mc.items()})
    if plan.saliency is not None and "outcome_saliency" not in given:
        from .saliency import outcome_saliency

        res["outcome_saliency"] = outcome_saliency(plan.saliency, policy, inp.input_ids, inp.attention_mask, P,
                                                   inp.response_mask, micro_batch_size=micro_batch_size)
    if plan.critic is not None:
        head_out = models.critic(res["hidden"]).squeeze(-1)
        res["values"] = torch.sigmoid(head_out) if plan.critic.transform == "sigmoid" else head_out
    return res


def join_prompts_and_responses(tokenizer, prompt_texts: Sequence[str], response_ids, response_mask, prefix: str = ""):
    """Left-padded prompts + right-padded responses -> one [N, P + T] input (keys with ``prefix``)."""
    enc = tokenizer(list(prompt_texts), return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    ids = torch.cat([enc["input_ids"], response_ids.to(enc["input_ids"].device)], dim=1)
    att = torch.cat([enc["attention_mask"], response_mask.to(enc["attention_mask"].dtype).to(enc["attention_mask"].device)], dim=1)
    return {f"{prefix}input_ids": ids, f"{prefix}attention_mask": att, f"{prefix}prompt_len": enc["input_ids"].shape[1]}


def oracle_texts(plan: SignalPlan, conversations: Sequence[Any], questions: Sequence[str], answers: Sequence[Any], render) -> List[Any]:
    """The prompts the oracle pass scores, one per row: each conversation (a list of chat
    messages, or a plain string prompt) with its last user message replaced by the declared
    oracle prompt of (question, answer); the conversation unchanged when the oracle sees the
    student's own prompt. ``render(conversation) -> str`` applies the chat template."""
    if plan.oracle is None:
        raise ValueError("oracle_texts: the plan has no oracle pass")
    texts = []
    for i, (conv, q, a) in enumerate(zip(conversations, questions, answers, strict=True)):
        if plan.oracle.prompt is not None:
            new = plan.oracle.prompt(q, a if isinstance(a, str) else str(a))
            if isinstance(conv, str):
                conv = new
            else:
                users = [j for j, m in enumerate(conv) if m.get("role") == "user"]
                if not users:
                    raise ValueError(f"oracle prompt: row {i} has no user message to replace")
                j = users[-1]
                conv = list(conv[:j]) + [{**conv[j], "content": new}] + list(conv[j + 1 :])
        texts.append(render(conv) if not isinstance(conv, str) else conv)
    return texts
