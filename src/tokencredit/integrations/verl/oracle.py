"""The oracle pass's inputs in verl (OPPO, OPD), built on the driver; pure functions, no Ray.

The oracle pass scores the batch's own responses after another prompt: the method's declared
oracle prompt (``OraclePass.prompt(question, answer)``: OPPO's and self-distillation's prompt
with the reference answer) or, for a teacher on the student's own prompt, the prompt unchanged.
From verl's data, per sample (fields the agent loop stores with every sample in TransferQueue):

* ``raw_prompt``: the chat messages of the prompt (verl's RLHFDataset ``prompt`` column); the
  question is the content of its last user message, which the oracle prompt replaces;
* ``reward_model["ground_truth"]``: the reference answer (verl's GSM8K / MATH preprocessing,
  ``examples/data_preprocess/gsm8k.py``, stores it there);
* ``responses`` / ``response_mask``: the sampled response tokens, appended unchanged.

The prompt is rendered with the run's tokenizer and chat template (``add_generation_prompt=True``,
as verl's agent loop does) and tokenised without special tokens. Each oracle sample has verl's
per-sample layout (``prompts``, ``responses``, ``input_ids = prompts + responses``,
``attention_mask``, ``position_ids``, ``response_mask``, ``loss_mask``), so the actor's
``compute_log_prob`` scores it like any rollout sample.

A **teacher-scored** oracle (``oracle=teacher``: OPPO's teacher-oracle, OPD with a teacher) is
scored by verl's own on-policy-distillation teacher servers (``distillation.teacher_models``,
vLLM): :func:`teacher_response_logprobs` sends each oracle prompt + response through verl's
``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single`` and reads the response's tokens
out of the prompt log-probs it returns (:func:`response_logprobs`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from ...engine.passes import oracle_texts
from ...credit.plan import SignalPlan

__all__ = [
    "ANSWER_FIELD",
    "question_of",
    "answer_of",
    "oracle_prompt_ids",
    "oracle_samples",
    "response_logprobs",
    "teacher_response_logprobs",
]

#: where verl's data preprocessing puts the reference answer
ANSWER_FIELD = ("reward_model", "ground_truth")


def question_of(conversation: Any) -> str:
    """The question of a prompt: its last user message (or the prompt, when it is a string)."""
    if isinstance(conversation, str):
        return conversation
    msgs = list(conversation) if conversation is not None else []
    users = [m for m in msgs if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users:
        raise ValueError(f"raw_prompt: expected chat messages with a user message, got {conversation!r}"[:300])
    content = users[-1].get("content")
    if not isinstance(content, str):
        raise ValueError(f"raw_prompt: expected the last user message's content to be text, got {type(content).__name__}")
    return content


def answer_of(reward_model: Any, row: int) -> str:
    """``reward_model["ground_truth"]`` of one sample, as text."""
    if not isinstance(reward_model, Mapping) or reward_model.get(ANSWER_FIELD[1]) is None:
        raise ValueError(
            f"reward_model: the oracle prompt needs the reference answer in reward_model['ground_truth'] (verl's "
            f"GSM8K/MATH preprocessing); row {row} has {reward_model!r}"[:400]
        )
    a = reward_model[ANSWER_FIELD[1]]
    return a if isinstance(a, str) else str(a)


def oracle_prompt_ids(
    plan: SignalPlan,
    tokenizer,
    raw_prompts: Sequence[Any],
    reward_models: Sequence[Any],
    *,
    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
) -> List[List[int]]:
    """The token ids of each row's oracle prompt (the declared prompt builder, the run's chat template)."""
    if plan.oracle is None:
        raise ValueError("oracle_prompt_ids: the plan has no oracle pass")
    if len(raw_prompts) != len(reward_models):
        raise ValueError(f"reward_models: expected one per prompt ({len(raw_prompts)}), got {len(reward_models)}")
    kw = dict(chat_template_kwargs or {})
    questions = [question_of(c) for c in raw_prompts]
    if plan.oracle.prompt is not None:
        answers = [answer_of(r, i) for i, r in enumerate(reward_models)]
    else:
        answers = [""] * len(raw_prompts)  # the student's own prompt: no answer read

    def render(conv):
        return tokenizer.apply_chat_template(list(conv), add_generation_prompt=True, tokenize=False, **kw)

    convs = [c if isinstance(c, str) else [dict(m) for m in c] for c in raw_prompts]
    texts = oracle_texts(plan, convs, questions, answers, render)
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def oracle_samples(
    prompt_ids: Sequence[Sequence[int]], responses: Sequence[torch.Tensor], response_masks: Sequence[torch.Tensor]
) -> List[Dict[str, torch.Tensor]]:
    """verl per-sample fields of the oracle inputs: each oracle prompt followed by the row's response."""
    if not (len(prompt_ids) == len(responses) == len(response_masks)):
        raise ValueError(
            f"oracle_samples: expected as many responses and masks as prompts ({len(prompt_ids)}), got "
            f"{len(responses)} and {len(response_masks)}"
        )
    out = []
    for i, (p, r, m) in enumerate(zip(prompt_ids, responses, response_masks)):
        if len(p) == 0:
            raise ValueError(f"oracle prompt of row {i}: expected at least one token, got none")
        prompts = torch.as_tensor(list(p), dtype=torch.int64)
        resp = torch.as_tensor(r, dtype=torch.int64).reshape(-1)
        rmask = torch.as_tensor(m).reshape(-1).to(torch.int64)
        if rmask.shape != resp.shape:
            raise ValueError(f"response_mask of row {i}: expected shape {tuple(resp.shape)}, got {tuple(rmask.shape)}")
        ids = torch.cat([prompts, resp])
        out.append(
            {
                "prompts": prompts,
                "responses": resp,
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(ids.shape[0], dtype=torch.int64),
                "response_mask": rmask,
                "loss_mask": rmask,
            }
        )
    return out


def response_logprobs(teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, prompt_len: int, response: torch.Tensor,
                      *, row: int = 0) -> torch.Tensor:
    """The teacher's log-probs of ``response``'s tokens, out of verl's teacher output for the whole
    sequence (prompt + response).

    verl's vLLM teacher returns, for a sequence of S tokens, S rows ``[S, K]`` shifted by one:
    row i holds the log-prob of token i + 1 (vLLM's first, empty prompt log-prob is dropped and a
    dummy 0 appended), and ``teacher_ids`` the token it scored. So response token j (sequence index
    P + j) is row P + j - 1. The ids are checked against the response: a shifted or truncated
    output is an error, not a silent misalignment. K must be 1 (the sampled token's log-prob: a
    non-top-k ``distillation.distillation_loss.loss_mode``)."""
    resp = torch.as_tensor(response).reshape(-1).to(torch.int64)
    ids = torch.as_tensor(teacher_ids)
    lp = torch.as_tensor(teacher_logprobs)
    if lp.dim() == 1:
        lp, ids = lp[:, None], ids.reshape(-1)[:, None]
    S, R = prompt_len + resp.shape[0], resp.shape[0]
    if lp.dim() != 2 or lp.shape[1] != 1 or tuple(ids.shape) != tuple(lp.shape):
        raise ValueError(
            f"teacher_logprobs of row {row}: expected [{S}, 1] (the sampled token's log-prob; a top-k distillation "
            f"loss_mode returns [S, k]) with matching teacher_ids, got {tuple(lp.shape)} and {tuple(ids.shape)}"
        )
    if lp.shape[0] != S:
        raise ValueError(f"teacher_logprobs of row {row}: expected {S} rows (prompt {prompt_len} + response {R}), got {lp.shape[0]}")
    got = ids[prompt_len - 1 : S - 1, 0].to(torch.int64)
    if not torch.equal(got, resp):
        bad = int((got != resp).nonzero()[0, 0])
        raise ValueError(
            f"teacher_ids of row {row}: expected the response's tokens at rows {prompt_len - 1}..{S - 2}; response "
            f"token {bad} is {int(resp[bad])}, the teacher scored {int(got[bad])}"
        )
    return lp[prompt_len - 1 : S - 1, 0].float()


def teacher_response_logprobs(manager, prompt_ids: Sequence[Sequence[int]], responses: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The teacher's log-probs of each response after its prompt, one request per row, concurrent.

    ``manager``: verl's ``AsyncTeacherLLMServerManager`` (or anything with its
    ``async compute_teacher_logprobs_single(sequence_ids=...) -> (ids [S, K], logprobs [S, K])``)."""
    import asyncio

    if len(prompt_ids) != len(responses):
        raise ValueError(f"responses: expected one per prompt ({len(prompt_ids)}), got {len(responses)}")
    seqs = [list(map(int, p)) + torch.as_tensor(r).reshape(-1).tolist() for p, r in zip(prompt_ids, responses)]

    async def score():
        return await asyncio.gather(*(manager.compute_teacher_logprobs_single(sequence_ids=s) for s in seqs))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        outs = asyncio.run(score())
    else:  # called from a running loop's thread: run it in its own thread
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            outs = pool.submit(asyncio.run, score()).result()
    return [response_logprobs(ids, lp, len(p), r, row=i) for i, ((ids, lp), p, r) in enumerate(zip(outs, prompt_ids, responses))]
