"""OPD / SDPO (on-policy distillation; self-distillation with privileged context).

    e_t     = log pi_O(y_t | ...) - log pi_theta(y_t | h_t)     oracle_logprobs - logprobs, detached
    e_t     = clip(e_t, -clip, clip)                             only if ``clip`` is set
    A_{b,t} = coefficient * e_t                                  on every valid token

The oracle O is a stronger frozen teacher scoring the student's own prompt, log pi_T(y_t | x, y_<t)
(``oracle="teacher"``, on-policy distillation), or the policy itself given privileged context,
the reference answer, log pi_theta(y_t | x+, y_<t) (``oracle="self"``, self-distillation, SDPO:
without the privileged context e_t would be 0). :func:`oracle_pass` declares that pass to the
trainers. Summed over the
response, ``sum_t -e_t`` is the single-sample estimate of the reverse KL
KL(pi_theta || pi_O) on the sampled tokens, so maximising ``sum_t A_t log pi_theta(y_t)``
with A_t = e_t is the per-token negative reverse-KL reward of on-policy distillation. No
outcome reward and no groups are used. OPPO's advantage reduces to this one when its
accumulation, state weight and anchoring are switched off (``oppo.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..batch import CreditBatch
from ..ops import masked_fill_zero, masked_mean
from ..registry import CreditOutput, OraclePass, register_estimator

__all__ = ["OPDConfig", "opd", "check_template", "distillation_evidence", "oracle_prompt", "oracle_pass", "DEFAULT_ORACLE_TEMPLATE"]

# reconstructed (research notes: "x+ = x plus the reference answer, a documented template"): the
# prompt unchanged and the answer appended, nothing else, so that the oracle differs from the
# policy by the answer only. The first version also asked to "Reason step by step toward it",
# which contradicts a prompt such as "Answer with just the number": on mul1 with SmolLM2-135M it
# tripled the evidence's bias (-0.18 vs -0.06 nats/token on the policy's own samples) and halved
# the part due to the answer (docs/methods.md, oppo, "Oracle template").
DEFAULT_ORACLE_TEMPLATE = "{prompt}\n\n(The correct answer is {answer}.)"

_PLACEHOLDER = re.compile(r"\{(prompt|answer)\}")


def check_template(template: object, where: str) -> None:
    """Raise ``ValueError`` (naming ``where``) unless ``template`` is a string holding both
    ``{prompt}`` and ``{answer}``: an oracle prompt's template (OPD's, OPPO's)."""
    if not isinstance(template, str):
        raise ValueError(f"{where}: expected a string with {{prompt}} and {{answer}}, got {type(template).__name__}")
    for key in ("{prompt}", "{answer}"):
        if key not in template:
            raise ValueError(f"{where}: expected the placeholder {key} in the template, got {template!r}"[:300])


def oracle_prompt(prompt: str, answer: str, template: str = DEFAULT_ORACLE_TEMPLATE) -> str:
    """The oracle prompt x+: ``template`` with ``{prompt}`` and ``{answer}`` filled in.

    Substitution is a single pass over the template, so braces elsewhere in the template
    (LaTeX such as ``\\boxed{}``) and placeholders inside the prompt or answer are left as they are.
    """
    check_template(template, "oracle_prompt template")
    if not isinstance(prompt, str):
        raise TypeError(f"oracle_prompt prompt: expected str, got {type(prompt).__name__}")
    if not isinstance(answer, str):
        answer = str(answer)
    values = {"prompt": prompt, "answer": answer}
    return _PLACEHOLDER.sub(lambda mt: values[mt.group(1)], template)




@dataclass
class OPDConfig:
    # the OPD reward is the raw log-ratio (on-policy distillation; docs/methods.md "OPD / SDPO");
    # a clip bounds the reward where teacher and student disagree wildly (None = no clip)
    clip: Optional[float] = None
    # the reward enters the policy gradient with weight 1 in on-policy distillation
    coefficient: float = 1.0
    # which model is the oracle: "self" = the policy given privileged context (the reference
    # answer, via oracle_template: self-distillation, SDPO); "teacher" = a frozen stronger model
    # scoring the student's own prompt (standard on-policy distillation; the trainer must be
    # given the teacher)
    oracle: str = "self"
    # the privileged context of self-distillation (used with oracle="self")
    oracle_template: str = DEFAULT_ORACLE_TEMPLATE

    def __post_init__(self):
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise ValueError(f"opd clip: expected None or a number > 0 (math.inf allowed), got {self.clip!r}")
        if not (isinstance(self.coefficient, (int, float)) and math.isfinite(self.coefficient) and self.coefficient > 0):
            raise ValueError(f"opd coefficient: expected a finite number > 0, got {self.coefficient!r}")
        if self.oracle not in ("self", "teacher"):
            raise ValueError(f"opd oracle: expected 'self' or 'teacher', got {self.oracle!r}")
        check_template(self.oracle_template, "opd oracle_template")


def distillation_evidence(batch: CreditBatch, clip: Optional[float] = None):
    """The detached log-ratio e_t = oracle_logprobs - logprobs on valid tokens, 0 on padding.

    Returns ``(e, raw)``: ``e`` clipped to [-clip, clip] when ``clip`` is a finite number,
    ``raw`` the unclipped log-ratio (for clip statistics). Shared with OPPO so both methods
    read the same evidence.
    """
    raw = masked_fill_zero(batch.oracle_logprobs.detach() - batch.logprobs.detach(), batch.mask)
    e = raw.clamp(-clip, clip) if clip is not None and math.isfinite(clip) else raw
    return e, raw


def oracle_pass(oracle: str, template: str, *, teacher_sees_oracle_prompt: bool) -> OraclePass:
    """The extra pass an oracle-prompted method declares: the policy on the oracle prompt
    (``oracle="self"``), or the teacher, on the oracle prompt (OPPO's teacher-oracle) or on the
    student's own prompt (on-policy distillation)."""

    def prompt(question: str, answer: str) -> str:
        return oracle_prompt(question, answer, template)

    if oracle == "self":
        return OraclePass(prompt=prompt, scorer="policy")
    return OraclePass(prompt=prompt if teacher_sees_oracle_prompt else None, scorer="teacher")


@register_estimator(
    "opd",
    config=OPDConfig,
    requires=("oracle_logprobs", "logprobs"),
    oracle=lambda c: oracle_pass(c.oracle, c.oracle_template, teacher_sees_oracle_prompt=False),
    provenance="paper",
    summary="per-token log-ratio of oracle (teacher or privileged self) to policy: negative reverse-KL reward",
)
def opd(batch: CreditBatch, config: OPDConfig) -> CreditOutput:
    e, raw = distillation_evidence(batch, config.clip)
    adv = masked_fill_zero(config.coefficient * e, batch.mask)
    m = batch.mask
    clipped = m & (raw.abs() > config.clip) if config.clip is not None else torch.zeros_like(m)
    return CreditOutput(
        advantages=adv,
        metrics={
            "opd/reward_mean": masked_mean(e, m).item(),
            # -mean(raw log-ratio): per-token reverse-KL estimate on the sampled tokens
            "opd/reverse_kl_est": -masked_mean(raw, m).item(),
            "opd/clip_frac": masked_mean(clipped.to(e.dtype), m).item(),
        },
    )
