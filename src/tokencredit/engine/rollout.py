"""Rollouts: K sampled responses per chat prompt, with the behaviour policy's log-probs.

    rb = HFRollout(model, tokenizer).generate(prompts, num_samples=4, max_new_tokens=64,
                                              temperature=0.7, top_p=1.0, seed=None)
    rb.response_ids, rb.response_mask, rb.behaviour_logprobs, rb.prompt_index, rb.texts

Layout of a :class:`RolloutBatch` (N = prompts x num_samples rows; the samples of one prompt
are contiguous, ``prompt_index`` says which prompt a row answers):

    prompt_ids     [N, P]  left-padded (the layout generation used)
    response_ids   [N, T]  right-padded with the pad token
    response_mask  [N, T]  1 up to and including the first EOS, 0 after it
    truncated      [N]     True when the response hit max_new_tokens without an EOS

``behaviour_logprobs[i, t]`` is the log of the probability with which the sampler drew
``response_ids[i, t]``: ``log_softmax(warp(logits_t / temperature))[token]``, where ``warp`` is
the top-p truncation (the logits outside the nucleus set to -inf), so a token inside the nucleus
gets its probability renormalised over the nucleus (``log p - log S``, S the nucleus mass; vLLM's
``processed_logprobs``). With ``top_p = 1`` (the default) nothing is truncated and the values are
``log_softmax(logits_t / temperature)[token]`` of the whole vocabulary. ``RolloutBatch.behaviour_distribution``
says which: ``"full"`` or ``"truncated"``. Recorded step by step inside ``generate``
(``_DrawnLogprobs``, after the warpers), or, with ``sampler="multinomial"``, from the logits
``generate`` returns (``output_logits=True``) through the same warpers. The trainer's own
log-probs are of the whole vocabulary: under top-p a rollout correction against these weighs
the update by the full policy over the sampler's (``docs/training.md``, rollout correction).
Greedy decoding (``temperature == 0``) reports ``log_softmax(logits)`` (temperature 1, "full").
Masked positions hold 0.

A vLLM (or other) backend only has to implement :class:`RolloutBackend`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from .attention import use_grouped_decode
from .forward import base_model

__all__ = [
    "HFRollout",
    "ReplayRollout",
    "RolloutBackend",
    "RolloutBatch",
    "NonFiniteLogitsError",
    "check_generate_args",
    "check_tokenizer",
    "clean_generation_config",
    "finite_check_processor",
    "response_mask_from_ids",
    "stop_token_ids",
]


class NonFiniteLogitsError(FloatingPointError):
    """The policy produced NaN/inf logits while sampling (a diverged or corrupted model)."""


def finite_check_processor():
    """A logits processor that stops generation at the first non-finite logit.

    Without it ``generate`` fails deep inside its sampler ("probability tensor contains inf,
    nan ...") and the message says nothing of where the values came from. The sum of the row
    block is finite exactly when every value is (barring an overflow of the sum, which falls back
    to the element check): one reduction instead of a V-wide mask per step.
    """
    from transformers import LogitsProcessor

    class _FiniteCheck(LogitsProcessor):
        def __init__(self):
            self.t = 0

        def __call__(self, input_ids, scores):
            if not bool(torch.isfinite(scores.sum())):
                bad = ~torch.isfinite(scores)
                if bad.any():
                    row = int(bad.any(-1).nonzero()[0])
                    raise NonFiniteLogitsError(
                        f"non-finite values in policy logits during rollout (new token {self.t}, row {row})"
                    )
            self.t += 1
            return scores

    return _FiniteCheck()


def inverse_cdf_choice(probs: torch.Tensor, u: torch.Tensor, block: int = 512) -> torch.Tensor:
    """The token each row draws for its uniform ``u`` in [0, 1): the first index whose cumulative
    probability reaches ``(1 - u) * total``, i.e. token ``i`` for ``u`` in an interval of width
    ``probs[i] / total``; a zero-probability token is never drawn. The sums are float64, so a token
    far below float32's resolution at 1 (~6e-8) keeps its probability. [n, V], [n] -> [n].

    In two levels, so that only one block of ``block`` entries per row is summed running: the
    float64 sums of the row's blocks and their running sum find the block where the target falls,
    then the running sum inside that block finds the token. A full float64 running sum over V
    (the earlier form) converts and writes the whole [n, V] block twice in float64; this converts
    it once for the block sums and writes [n, V / block]. The two forms agree up to float64's
    rounding of the sums (a draw moves only if ``u`` lands within ~1e-16 of an interval's end)."""
    n, V = probs.shape
    nb = -(-V // block)
    if nb * block != V:
        probs = F.pad(probs, (0, nb * block - V))
    blocks = probs.reshape(n, nb, block)
    bcdf = blocks.sum(-1, dtype=torch.float64).cumsum_(-1)  # [n, nb]
    v = (1.0 - u.to(torch.float64)).unsqueeze(-1) * bcdf[:, -1:]  # [n, 1]
    blk = torch.searchsorted(bcdf, v).clamp_(max=nb - 1)  # first block whose running sum reaches v
    before = torch.where(blk > 0, bcdf.gather(-1, (blk - 1).clamp(min=0)), torch.zeros_like(v))
    inside = blocks[torch.arange(n, device=probs.device), blk.squeeze(-1)]  # [n, block]
    j = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), v - before)
    # the block's own running sum can round below its block sum: never past its last nonzero entry
    last = block - 1 - (inside > 0).flip(-1).to(torch.int8).argmax(-1, keepdim=True)
    return (blk * block + torch.minimum(j, last)).squeeze(-1).clamp_(max=V - 1)


class _DrawnLogprobs:
    """A logits processor that records the log-probs of the drawn tokens, one step late: each call
    gathers the previous step's ``log_softmax(scores)`` at the token drawn from it (the last of
    ``input_ids``) and keeps only this step's, so a call holds one [n, V] block instead of
    ``generate``'s ``output_logits`` (rows x new tokens x V floats). Placed after the warpers and
    right before the draw, ``scores`` are what the token is drawn from (``logits / T``, top-p
    truncated when ``top_p < 1``): the values are the log-probs of the sampling distribution, and
    with ``top_p = 1`` equal ``log_softmax(logits / T)`` of the returned logits, bit for bit."""

    def __init__(self):
        self.prev = None
        self.got: List[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.got.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = F.log_softmax(scores, dim=-1)
        return scores

    def logprobs(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[n, T] log-probs of the T tokens ``generate`` returned (a last step it undid is dropped)."""
        T = new_tokens.shape[1]
        got = self.got[:T]
        if len(got) < T:  # the last returned token was drawn from the last recorded step
            got.append(self.prev.gather(-1, new_tokens[:, T - 1 : T].to(self.prev.device)).squeeze(-1))
        return torch.stack(got, 1).float() if got else torch.zeros(new_tokens.shape)


def _sampling_processors(temperature: float, top_p: float, record: Optional[_DrawnLogprobs] = None) -> list:
    """Sampling as logits processors on greedy decoding: HF's own temperature and top-p warpers,
    then a draw from the softmax by inverse transform (one uniform per row, from torch's global
    generator), returned as scores in which only the drawn token is finite, so that greedy
    decoding picks it. The distribution is ``generate``'s (``softmax`` then
    ``torch.multinomial``); the cost is not: torch's CPU ``multinomial`` draws an exponential
    variate for every vocabulary entry, 185 ms of a 128-row step of the embedded model against
    9 ms for a cumulative sum and a binary search (docs/performance.md)."""
    from transformers import LogitsProcessor

    class _InverseCDFSample(LogitsProcessor):
        def __call__(self, input_ids, scores):
            probs = torch.softmax(scores, dim=-1)
            u = torch.rand(scores.shape[0], device=scores.device)
            tok = inverse_cdf_choice(probs, u)
            # in place: generate's scores for this step are its own copy, used for nothing else
            return scores.fill_(float("-inf")).scatter_(1, tok.unsqueeze(-1), 0.0)

    # the log-probs are recorded from the scores the draw sees: after temperature AND top-p
    return _warpers(temperature, top_p) + ([record] if record is not None else []) + [_InverseCDFSample()]


def _warpers(temperature: float, top_p: float) -> list:
    """HF's temperature and top-p warpers, as ``generate`` applies them (none when off)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
    return warpers


Messages = Sequence[Dict[str, str]]


@dataclass
class RolloutBatch:
    """One round of rollouts; see the module docstring for the layout."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] long
    response_ids: torch.Tensor  # [N, T] long, right-padded
    response_mask: torch.Tensor  # [N, T] long, 1 up to and including EOS
    behaviour_logprobs: torch.Tensor  # [N, T] float32, 0 at masked positions
    prompt_index: torch.Tensor  # [N] long
    texts: List[str]  # decoded responses, special tokens skipped
    truncated: torch.Tensor  # [N] bool
    temperature: float = 1.0  # the temperature the log-probs are scaled with (1.0 for greedy)
    # which distribution behaviour_logprobs are of: "full" (log_softmax(logits / T) over the whole
    # vocabulary) or "truncated" (renormalised over the top-p / top-k support the sampler drew from)
    behaviour_distribution: str = "full"

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        """P: response token t sits at position P + t of :attr:`input_ids`."""
        return int(self.prompt_ids.shape[1])

    @property
    def input_ids(self) -> torch.Tensor:
        """``[N, P + T]`` prompt + response, for a teacher-forced training forward."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[N, P + T]``: the prompt mask, then the response mask (padding after EOS is masked)."""
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[N]`` number of response tokens, EOS included."""
        return self.response_mask.sum(1)


@runtime_checkable
class RolloutBackend(Protocol):
    """What the trainer needs from a generator: :class:`HFRollout` (HF ``generate``),
    :class:`ReplayRollout` (fixed responses); a vLLM backend implements the same two calls.

    ``generate``: ``num_samples`` responses to each chat prompt, as a :class:`RolloutBatch`
    (layout in the module docstring); sampling draws from torch's global RNG (checkpointed by the
    trainer), or from a private stream seeded with ``seed`` that leaves the global RNG untouched.
    ``weights_changed``: the trainer's weights changed (an optimizer step, a loaded checkpoint);
    a backend that generates from its own copy of the weights syncs them before its next call.
    ``Trainer(cfg, rollout=...)`` takes a backend, or a callable ``(model, tokenizer) -> backend``
    called with the trainer's (possibly LoRA-wrapped) model."""

    def generate(
        self,
        prompts: List[List[Dict[str, str]]],
        *,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: Optional[int],
    ) -> RolloutBatch: ...

    def weights_changed(self) -> None: ...


def response_mask_from_ids(response_ids: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """``[N, T]`` long mask: 1 up to and including the first stop token of each row, 0 after."""
    is_stop = torch.isin(response_ids, torch.as_tensor(list(stop_ids), device=response_ids.device))
    stops_before = is_stop.long().cumsum(1) - is_stop.long()  # stop tokens strictly before t
    return (stops_before == 0).long()


def check_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer a rollout cannot use (no pad token, no chat template), in one line."""
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer: expected a pad token (tokencredit.engine.models.prepare_tokenizer sets eos), got none")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("tokenizer: expected a chat template (prompts are chat messages), got none")


def check_generate_args(prompts, num_samples, max_new_tokens, temperature, top_p) -> None:
    """Refuse bad arguments of :meth:`RolloutBackend.generate` in one line naming the field."""
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts: expected a non-empty list of chat-message lists, got {type(prompts).__name__} {prompts!r:.80}")
    for i, p in enumerate(prompts):
        if isinstance(p, str) or not isinstance(p, (list, tuple)) or not all(isinstance(m, dict) for m in p):
            raise ValueError(
                f"prompts[{i}]: expected a list of chat messages like [{{'role': 'user', 'content': ...}}], got {p!r:.80}"
            )
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(f"num_samples: expected an integer >= 1, got {num_samples}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected in (0, 1], got {top_p}")


def stop_token_ids(tokenizer, model) -> List[int]:
    """The tokenizer's EOS plus any EOS ``model``'s generation config declares (a peft model: its base's)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gc_eos = getattr(getattr(base_model(model), "generation_config", None), "eos_token_id", None)
    if gc_eos is not None:
        ids.update(int(i) for i in (gc_eos if isinstance(gc_eos, (list, tuple)) else [gc_eos]))
    if not ids:
        raise ValueError("tokenizer: expected an eos_token (generation must be able to stop), got none")
    return sorted(ids)


@contextlib.contextmanager
def clean_generation_config(model, tokenizer, stop_ids: List[int]) -> Iterator[None]:
    """``model``'s generation config replaced by a neutral one (only BOS, ``stop_ids``, pad) for the duration.

    ``generate()`` fills every setting left unset from ``model.generation_config`` (repetition
    penalties, top_k, suppressed tokens, ...), which would make the samples come from a different
    distribution than the log-probs describe."""
    from transformers import GenerationConfig

    hf = base_model(model)
    saved = hf.generation_config
    hf.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id
    )
    try:
        yield
    finally:
        hf.generation_config = saved


class HFRollout:
    """:class:`RolloutBackend` on ``model.generate`` (a transformers or peft causal LM).

    ``max_batch_size`` bounds the rows per ``generate`` call (the returned logits take
    rows x new tokens x vocab floats); ``None`` generates all rows at once. When the rows need
    several calls, prompts are bucketed by token length (a prompt's samples together) and each
    call is padded to its own longest prompt.
    ``share_prompts`` runs the K copies of a prompt through the model once before generation
    (see :meth:`_shared_prefix`); False leaves generation entirely to ``generate``.
    Sampling uses the global torch RNG, or a private stream when ``seed`` is given (the
    global RNG is then left untouched), so the same seed gives the same samples on CPU.
    ``dtype`` (e.g. ``torch.bfloat16``): generate with a copy of the model in that dtype, made on
    first use and re-synced from ``model`` after :meth:`weights_changed` (call it after each
    optimizer step); the log-probs are still computed in fp32 from the returned logits. None generates with ``model`` itself.
    On the CPU the copy decodes with :func:`~tokencredit.engine.attention.grouped_decode_attention`
    (0.65-0.86x the time of torch's flash kernel in bf16, benchmarks/decode_attention.py); ``model`` keeps its own attention.
    ``sampler``: ``"inverse_cdf"`` (default; :func:`_sampling_processors`, the same distribution
    at a fraction of the cost) or ``"multinomial"`` (``generate``'s own ``torch.multinomial``: the
    random stream of tokencredit before 2026-12-05, with which the bundled fidelity sets' policies
    were trained).
    """

    SAMPLERS = ("inverse_cdf", "multinomial")

    def __init__(self, model, tokenizer, *, max_batch_size: Optional[int] = None, share_prompts: bool = True,
                 dtype: Optional[torch.dtype] = None, sampler: str = "inverse_cdf"):
        if sampler not in self.SAMPLERS:
            raise ValueError(f"rollout.sampler: expected one of {list(self.SAMPLERS)}, got {sampler!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1 or None, got {max_batch_size}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype: expected a floating torch dtype or None, got {dtype!r}")
        check_tokenizer(tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.share_prompts = share_prompts
        self.dtype = dtype
        self.sampler = sampler
        self._copy = None  # the low-precision copy (dtype set)
        self._stale = False

    def weights_changed(self) -> None:
        """Tell a ``dtype`` rollout that ``model``'s weights changed (an optimizer step, a loaded
        checkpoint): the next ``generate`` copies them into its low-precision copy first. (Torch's
        fused optimizers update in place without bumping version counters, so this is explicit.)"""
        self._stale = True

    def generation_model(self):
        """The model ``generate`` runs: ``model``, or its ``dtype`` copy brought up to date."""
        if self.dtype is None:
            return self.model
        if self._copy is None:
            import copy

            self._copy = copy.deepcopy(self.model).to(self.dtype)
            self._copy.requires_grad_(False)
            if next(self._copy.parameters()).device.type == "cpu":
                # the copy is the rollout's own: its decode steps skip the CPU flash kernel (attention.py)
                use_grouped_decode(base_model(self._copy))
        elif self._stale:
            dst = dict(self._copy.named_parameters())
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    dst[n].copy_(p)
        self._stale = False
        return self._copy

    # -- helpers ---------------------------------------------------------------------------
    def _hf_model(self):
        """The transformers model ``generate`` runs (the ``dtype`` copy if made; a peft model's base)."""
        return base_model(self._copy if self._copy is not None else self.model)

    def _shared_prefix(self, enc, prompt_index: torch.Tensor, device) -> Dict[str, object]:
        """The KV cache for generate (``past_key_values``, ``cache`` in newer transformers): every
        distinct prompt but its last token, run once.

        ``generate`` would prefill each of the K copies of a prompt on its own; the states are the
        same for all of them, so the prompt is run once and its KV cache indexed out to its rows
        (generate then runs the last prompt token and decodes as usual: same logits up to float
        rounding). Nothing is shared when every row has its own prompt.
        """
        from .forward import cache_name, prompt_cache

        uniq, inverse = torch.unique(prompt_index, return_inverse=True)
        P = int(enc["input_ids"].shape[1])
        if len(uniq) == len(prompt_index) or P < 2:
            return {}
        ids, att = enc["input_ids"][:, : P - 1].to(device), enc["attention_mask"][:, : P - 1].to(device)
        model = self.generation_model()
        _, cache = prompt_cache(model, ids, att, uniq.to(device), inverse.to(device))
        return {cache_name(model): cache}

    @staticmethod
    def _bucketed_rows(prompt_index: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
        """The rows in the order their chunks are generated: prompts by token length (a prompt's
        samples stay together), so that each ``max_batch_size`` chunk pads to similar lengths."""
        by_len = torch.argsort(prompt_lengths, stable=True)
        rank = torch.empty_like(by_len)
        rank[by_len] = torch.arange(len(by_len))
        return torch.argsort(rank[prompt_index] * len(prompt_index) + torch.arange(len(prompt_index)), stable=True)

    # -- the backend -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: List[List[Dict[str, str]]],
        *,
        num_samples: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
    ) -> RolloutBatch:
        check_generate_args(prompts, num_samples, max_new_tokens, temperature, top_p)
        tok = self.tokenizer
        texts = [tok.apply_chat_template(list(m), tokenize=False, add_generation_prompt=True) for m in prompts]
        # the template already writes the special tokens; add_special_tokens=False avoids a second BOS
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        prompt_index = torch.arange(len(prompts)).repeat_interleave(int(num_samples))
        prompt_ids = enc["input_ids"][prompt_index]
        prompt_mask = enc["attention_mask"][prompt_index]
        N, P = prompt_ids.shape
        gen = self.generation_model()
        device = next(gen.parameters()).device
        stop_ids = stop_token_ids(tok, self._hf_model())
        pad = int(tok.pad_token_id)
        greedy = temperature == 0
        t_lp = 1.0 if greedy else float(temperature)
        # "multinomial": generate samples itself; "inverse_cdf": logits processors on greedy decoding
        hf_samples = not greedy and self.sampler == "multinomial"

        from transformers import GenerationConfig

        gen_cfg = GenerationConfig(
            max_new_tokens=int(max_new_tokens),
            do_sample=hf_samples,
            **({"temperature": t_lp, "top_p": float(top_p), "top_k": 0} if hf_samples else {}),
            bos_token_id=tok.bos_token_id,
            eos_token_id=stop_ids,
            pad_token_id=pad,
            output_logits=hf_samples,  # otherwise _DrawnLogprobs records the log-probs as it goes
            return_dict_in_generate=True,
        )

        step = self.max_batch_size or N
        order = self._bucketed_rows(prompt_index, enc["attention_mask"].sum(1)) if N > step else torch.arange(N)
        chunks = []
        was_training = gen.training
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else []) if seed is not None else contextlib.nullcontext()
        gen.eval()
        try:
            from .precision import bf16_attention

            attention = bf16_attention(device.type) if self.dtype == torch.bfloat16 else contextlib.nullcontext()
            with rng, clean_generation_config(self._hf_model(), tok, stop_ids), attention:
                if seed is not None:
                    torch.manual_seed(int(seed))
                for s in range(0, N, step):
                    rows = order[s : s + step]
                    # a chunk is left-padded to its own longest prompt (bucketing keeps them alike)
                    cP = int(prompt_mask[rows].sum(1).max())
                    ids = prompt_ids[rows][:, P - cP :].to(device)
                    att = prompt_mask[rows][:, P - cP :].to(device)
                    cenc = {k: enc[k][:, P - cP :] for k in ("input_ids", "attention_mask")}
                    prefix = self._shared_prefix(cenc, prompt_index[rows], device) if self.share_prompts else {}
                    record = None if hf_samples else _DrawnLogprobs()
                    processors = ([] if hf_samples else [record] if greedy else _sampling_processors(t_lp, float(top_p), record))
                    out = gen.generate(
                        input_ids=ids, attention_mask=att, generation_config=gen_cfg,
                        logits_processor=[finite_check_processor()] + processors,
                        **prefix,
                    )
                    resp = out.sequences[:, cP:].cpu()
                    if record is not None:
                        lp = record.logprobs(out.sequences[:, cP:]).cpu()
                    else:
                        lp = torch.zeros(resp.shape, dtype=torch.float32)
                        nucleus = _warpers(1.0, float(top_p))  # generate's top-p, on the scaled logits
                        for t, logits in enumerate(out.logits):  # one [n, V] tensor per new token
                            scores = logits.float() / t_lp
                            for w in nucleus:
                                scores = w(None, scores)
                            logp = F.log_softmax(scores, dim=-1)
                            lp[:, t] = logp.gather(-1, resp[:, t : t + 1].to(logp.device)).squeeze(-1).cpu()
                    del out
                    chunks.append((rows, resp, lp))
        finally:
            gen.train(was_training)

        T = max(r.shape[1] for _, r, _ in chunks)
        response_ids = torch.full((N, T), pad, dtype=torch.long)
        behaviour = torch.zeros((N, T), dtype=torch.float32)
        for rows, resp, lp in chunks:
            t = resp.shape[1]
            response_ids[rows, :t] = resp
            behaviour[rows, :t] = lp
        # A chunk shorter than T stopped early because every row in it had stopped, so the pad
        # after its end always comes after an EOS: the mask is right without knowing chunk ends.
        response_mask = response_mask_from_ids(response_ids, stop_ids)
        truncated = ~torch.isin(response_ids, torch.tensor(stop_ids)).any(1)
        keep = response_mask.bool()
        response_ids = torch.where(keep, response_ids, torch.full_like(response_ids, pad))
        behaviour = torch.where(keep, behaviour, torch.zeros_like(behaviour))
        lengths = response_mask.sum(1).tolist()
        decoded = tok.batch_decode([response_ids[i, : lengths[i]].tolist() for i in range(N)], skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            behaviour_logprobs=behaviour,
            prompt_index=prompt_index,
            texts=decoded,
            truncated=truncated,
            temperature=t_lp,
            behaviour_distribution="truncated" if not greedy and top_p < 1 else "full",
        )


class ReplayRollout:
    """:class:`RolloutBackend` that serves fixed responses instead of sampling from the model.

    The tokens do not depend on any float the model computes, so a run trained on them gives the
    same batches on every CPU (a sampled token flips when a logit's last digit moves between
    kernels, and the runs part): tests pin a trainer's output through it, and a user can replay
    responses through a new method or loss without the sampler in the way.

    ``responses(key, row, max_new_tokens) -> token ids`` gives row ``row``'s response (prompt
    ``row // num_samples``) of a call; ``key`` is ``seed`` when the call passes one (eval), else
    one integer drawn from torch's global RNG (which the trainer checkpoints, so a resumed run
    replays what the uninterrupted one did). The ids are cut after the first stop token and at
    ``max_new_tokens``. Default: :func:`seeded_responses` over the tokenizer's non-special tokens.
    ``behaviour_logprobs`` are the model's, teacher-forced on the replayed tokens
    (``log_softmax(logits / temperature)``; temperature 0 reports temperature 1, as
    :class:`HFRollout` does), so the loss sees a consistent behaviour policy; they are of the whole
    vocabulary (``behaviour_distribution="full"``: the tokens were not drawn from the model, and
    ``top_p`` is not applied).
    """

    def __init__(self, model, tokenizer, responses=None, *, p_stop: float = 0.25):
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("tokenizer: expected a pad and an eos token, got none")
        self.model = model
        self.tokenizer = tokenizer
        self.stop_id = int(tokenizer.eos_token_id)
        if responses is None:
            special = set(tokenizer.all_special_ids)
            vocab = [i for i in range(len(tokenizer)) if i not in special]
            responses = seeded_responses(vocab, self.stop_id, p_stop=p_stop)
        self.responses = responses

    def weights_changed(self) -> None:
        """Nothing to sync: the log-probs are computed with the trainer's model itself."""

    @torch.no_grad()
    def generate(self, prompts, *, num_samples: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None) -> RolloutBatch:
        from .forward import forward_response

        tok = self.tokenizer
        texts = [tok.apply_chat_template(list(m), tokenize=False, add_generation_prompt=True) for m in prompts]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        prompt_index = torch.arange(len(prompts)).repeat_interleave(int(num_samples))
        prompt_ids, prompt_mask = enc["input_ids"][prompt_index], enc["attention_mask"][prompt_index]
        key = int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)))
        rows = []
        for i in range(len(prompt_index)):
            ids = [int(t) for t in self.responses(key, i, int(max_new_tokens))][: int(max_new_tokens)]
            if not ids:
                raise ValueError(f"responses: expected at least one token for row {i}, got none")
            rows.append(ids[: ids.index(self.stop_id) + 1] if self.stop_id in ids else ids)
        N, T, pad = len(rows), max(len(r) for r in rows), int(tok.pad_token_id)
        response_ids = torch.full((N, T), pad, dtype=torch.long)
        response_mask = torch.zeros((N, T), dtype=torch.long)
        for i, r in enumerate(rows):
            response_ids[i, : len(r)] = torch.tensor(r)
            response_mask[i, : len(r)] = 1
        t_lp = 1.0 if temperature == 0 else float(temperature)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            _, logits = forward_response(self.model, torch.cat([prompt_ids, response_ids], 1).to(device),
                                         torch.cat([prompt_mask, response_mask], 1).to(device), prompt_ids.shape[1])
        finally:
            self.model.train(was_training)
        lp = F.log_softmax(logits.float() / t_lp, -1).gather(-1, response_ids.to(device).unsqueeze(-1)).squeeze(-1).cpu()
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
            behaviour_logprobs=lp * response_mask, prompt_index=prompt_index,
            texts=tok.batch_decode(rows, skip_special_tokens=True),
            truncated=torch.tensor([self.stop_id not in r for r in rows]), temperature=t_lp,
        )


def seeded_responses(vocab: Sequence[int], stop_id: int, *, p_stop: float = 0.25):
    """``responses`` for :class:`ReplayRollout`: row ``row`` of call ``key`` draws tokens from
    ``vocab`` with numpy's PCG64 seeded by ``(key, row)`` (integer arithmetic: the same ids on
    every machine), each position the stop token with probability ``p_stop``."""
    import numpy as np

    vocab = np.asarray(list(vocab), dtype=np.int64)
    if vocab.size == 0:
        raise ValueError("vocab: expected at least one token id, got none")

    def responses(key: int, row: int, max_new_tokens: int) -> List[int]:
        g = np.random.default_rng([int(key) % 2**63, int(row)])
        stop = g.random(max_new_tokens) < p_stop
        ids = vocab[g.integers(0, vocab.size, max_new_tokens)]
        return [stop_id if s else int(t) for s, t in zip(stop, ids)]

    return responses
