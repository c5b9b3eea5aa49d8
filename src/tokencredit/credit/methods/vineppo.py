"""VinePPO (Kazemnejad et al. 2024, ``McGill-NLP/VinePPO``): Monte Carlo step values replace the critic.

The response is cut into reasoning steps s = 0..n-1 (:func:`split_steps`); the value of the
state before each step is estimated from K fresh continuations of the current policy (the
declared continuation pass, :mod:`tokencredit.engine.continuations`):

    V_s   = (1/K) sum_j R(y_{<s} + c_j),  c_j ~ pi(. | x, y_{<s})     s <= max_steps
    V_s   = R                                                         s >  max_steps (not sampled;
                                                                        the authors' backward fill)
    V_n   = R                       (terminal value 0 plus the outcome reward on the last step)
    A_s   = V_{s+1} - V_s           (gamma = 1: step reward 0 but on the last step)
    A_t   = A_{s(t)}                every token of step s(t) (the step of its first character)
    A     <- (A - mean A) / sqrt(var A + 1e-8)     whiten=True: over the batch's valid tokens,
                                                  unbiased variance (the authors' masked_whiten)

Defaults from the authors' configs: K = 9 (``episode_generators/9rolls.jsonnet``), max_steps = 20
(``math_episode_generator_w_mc_adv.jsonnet``; 25 in the GSM8K configs), whitened advantages
(``trainers/ppo_MATH.jsonnet``), gamma = 1. The step split is the GSM8K task's
(``tasks/gsm8k.py``: split on "\\n", leading empty steps merged into the first, the answer
"\\n#### ..." merged into the last non-empty step); the MATH configs' in-place LaTeX-aware
split (``math_extract_steps_inplace.py``) is not reproduced. Deviations: docs/methods.md.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..batch import CreditBatch
from ..ops import masked_fill_zero, masked_mean
from ..registry import ContinuationPass, CreditOutput, register_estimator


@dataclass
class VinePPOConfig:
    k: int = 9  # continuations per step prefix (the authors' 9rolls)
    max_steps: Optional[int] = 20  # steps past this index are not sampled: V = R (authors' max_step_for_value_estimation)
    # the step delimiter (GSM8K task: intermediate_step_delimiter), written with backslash escapes
    # (a config string is never blank): "\\n" is a newline
    delimiter: str = "\\n"
    answer_prefix: Optional[str] = "\\n#### "  # merged with the last step (GSM8K task: answer_prefix; escapes as delimiter); None: no answer
    whiten: bool = True  # whiten the token advantages over the batch (ppo_MATH: whiten_advantages)
    eps: float = 1e-8  # inside the whitening's rsqrt, as masked_whiten

    def __post_init__(self):
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"vineppo k: expected an int >= 1, got {self.k!r}")
        if self.max_steps is not None and not (isinstance(self.max_steps, int) and self.max_steps >= 0):
            raise ValueError(f"vineppo max_steps: expected None or an int >= 0, got {self.max_steps!r}")
        if not unescape(self.delimiter):
            raise ValueError(f"vineppo delimiter: expected a non-empty string, got {self.delimiter!r}")
        if not self.eps > 0:
            raise ValueError(f"vineppo eps: expected > 0, got {self.eps}")


def unescape(s: Optional[str]) -> Optional[str]:
    """A config string with backslash escapes (``"\\n"``) as the text it stands for."""
    return None if s is None else codecs.decode(s, "unicode_escape")


def split_steps(text: str, delimiter: str = "\n", answer_prefix: Optional[str] = "\n#### ") -> List[int]:
    """Character offsets ``[0, ..., len(text)]`` of the steps: step i is ``text[idx[i]:idx[i+1]]``
    (a delimiter belongs to the step it opens)."""
    body, answer = text, None
    if answer_prefix is not None:
        parts = text.split(answer_prefix)
        if len(parts) == 2:
            body, answer = parts
    steps = body.split(delimiter)
    first = next((i for i, st in enumerate(steps) if st.strip() != ""), None)
    if first:  # leading empty steps join the first non-empty one
        steps = [delimiter.join(steps[: first + 1])] + steps[first + 1:]
    if answer is not None:  # the answer joins the last non-empty step (the whole text when none is)
        last = next((i for i in range(len(steps) - 1, -1, -1) if steps[i].strip() != ""), 0)
        steps = steps[:last] + [delimiter.join(steps[last:]) + answer_prefix + answer]
    idx = [0]
    for i, st in enumerate(steps):
        idx.append(idx[-1] + len(st) + (len(delimiter) if i else 0))
    return idx


@dataclass(frozen=True)
class StepCuts:
    """The continuation pass's cut rule: the first token of each step of :func:`split_steps` on
    the concatenated token texts (a token belongs to the step of its first character; an empty
    last token, the end token, to the last step; a step in which no token starts joins the one before)."""

    delimiter: str
    answer_prefix: Optional[str]

    def __call__(self, token_texts: Sequence[str], logprobs=None) -> List[int]:
        text = "".join(token_texts)
        bounds = split_steps(text, self.delimiter, self.answer_prefix)
        cuts, pos, s = [], 0, -1
        for t, piece in enumerate(token_texts):
            step = sum(1 for b in bounds[1:-1] if b <= pos) if pos < len(text) else len(bounds) - 2
            if step > s:
                cuts.append(t)
                s = step
            pos += len(piece)
        return cuts or [0]


def _continuations(cfg: VinePPOConfig) -> ContinuationPass:
    return ContinuationPass(cuts=StepCuts(unescape(cfg.delimiter), unescape(cfg.answer_prefix)), k=cfg.k, max_steps=cfg.max_steps)


def step_advantages(batch: CreditBatch, max_steps: Optional[int]) -> torch.Tensor:
    """``[B, T]`` A_t = V_{s(t)+1} - V_{s(t)}, V of the steps past ``max_steps`` and after the last := R."""
    m = batch.mask
    starts = (batch.step_starts > 0.5) & m
    R = batch.rewards.to(torch.float64).unsqueeze(1).expand(m.shape)
    step = starts.long().cumsum(1) - 1
    v = batch.mc_values.to(torch.float64)
    if max_steps is not None:
        v = torch.where(step > max_steps, R, v)
    nxt = torch.empty_like(v)
    carry = R[:, 0].clone()
    for t in range(m.shape[1] - 1, -1, -1):  # the value at the next step's start, R after the last
        nxt[:, t] = carry
        carry = torch.where(starts[:, t], v[:, t], carry)
    return masked_fill_zero(nxt - v, m)


@register_estimator(
    "vineppo",
    config=VinePPOConfig,
    requires=("mc_values", "step_starts"),
    provenance="ref-code",
    summary="Monte Carlo step values from K fresh continuations replace the critic: A_s = V_{s+1} - V_s, whitened",
    continuations=_continuations,
)
def vineppo(batch: CreditBatch, config: VinePPOConfig) -> CreditOutput:
    m = batch.mask
    a = step_advantages(batch, config.max_steps)
    if config.whiten:
        n = m.sum()
        mean = masked_mean(a, m)
        var = masked_mean((a - mean) ** 2, m) * (n / (n - 1) if n > 1 else 1.0)
        a = (a - mean) * torch.rsqrt(var + config.eps)
    starts = (batch.step_starts > 0.5) & m
    return CreditOutput(
        advantages=masked_fill_zero(a, m).to(batch.rewards.dtype),
        metrics={
            "vineppo/steps_mean": float(starts.sum(1).float().mean()),
            "vineppo/mc_value_mean": masked_mean(batch.mc_values, starts).item() if starts.any() else 0.0,
        },
    )
