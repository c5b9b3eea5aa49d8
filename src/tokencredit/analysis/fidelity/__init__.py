"""Credit fidelity: every method's token credit scored against ground-truth credit.

PACT's axioms give the true credit of token t under the current policy,
``c_t = V(h_{t+1}) - V(h_t)``, where ``V(h)`` is the probability that the policy, continuing
from prefix ``h`` (the prompt and the first t response tokens), succeeds; after the last token
``V := R``. The package, one job a module (docs/fidelity.md):

- :mod:`.sampling`: ``M`` continuations of every prefix from the policy that produced the
  rollouts, at the rollout temperature and within the rollout's token budget, the prefixes' KV
  cache shared and several prefixes batched (:func:`sample_continuations`); the check that a
  model is that policy (:func:`check_policy`); a fresh batch from the trainer's own step at
  learning rate 0 (:func:`sample_batch`). :mod:`.crn`: common random numbers for the
  continuations of neighbouring prefixes.
- :mod:`.estimates`: V estimated by Monte Carlo and scored by the task's reward
  (:func:`build_estimates`; the file is rewritten after every batch and a rerun resumes), the
  file's format and loading (:func:`load_estimates`), a critic stored in it
  (:func:`attach_critic`), and the true credit read from it (:func:`span_values`,
  :func:`token_credit`). :mod:`.exact`: the exact tier, V by enumerating every continuation of
  a restricted-vocabulary policy.
- :mod:`.metrics`: every registered method and a few compositions replayed on the estimates'
  batch as ``tokencredit inspect`` replays, scored per trajectory and averaged, with a bootstrap
  interval over prompt groups (:func:`score`, :func:`trajectory_metrics`), the split-half noise
  reference and the noise ceiling (:func:`spearman_brown`), the table (:func:`format_table`).
- :mod:`.claims`: the numbers behind docs/fidelity.md's answers to the papers' claims (the only
  module here that names methods). :mod:`.plots`: the figure. :mod:`.cli`: ``tokencredit
  fidelity [FILE]``, ``fidelity build``, ``fidelity critic``.
- :mod:`.base`: what they share (the format tag, :class:`FidelityError`, the batch's rows and
  fingerprint, the bundled sets' paths).

``tokencredit fidelity`` with no argument scores the bundled reference set
(``tokencredit/data/fidelity_reference.pt``, built by ``scripts/build_fidelity_set.py``).
The fidelity package imports the core (records, trainer, models, tasks); nothing in the core
imports it.
"""

from __future__ import annotations

from .base import (
    FORMAT,
    REFERENCE_EXACT,
    REFERENCE_EXACT_COMMAND,
    REFERENCE_SET,
    REFERENCE_SPANS_CRN,
    REFERENCE_TOKENS,
    REFERENCE_TOKENS_CRN,
    FidelityError,
    batch_fingerprint,
    mc_positions,
    response_rows,
)
from .claims import CLAIM_SPECS, FIGURE_SPECS, claims, format_claims
from .cli import main
from .estimates import (
    attach_critic,
    build_estimates,
    complete_rows,
    credit_spans,
    critic_values,
    is_estimates_file,
    load_estimates,
    rollouts_with_true_credit,
    span_sums,
    span_values,
    standard_errors,
    token_credit,
)
from .metrics import (
    METRICS,
    FidelityConfig,
    bootstrap_mean,
    format_table,
    is_constant,
    mixed_groups,
    row_scores,
    score,
    spearman,
    spearman_brown,
    top_weights,
    trajectory_metrics,
)
from .plots import plot_responses
from .sampling import check_policy, prompt_rows, sample_batch, sample_continuations

__all__ = [
    "CLAIM_SPECS",
    "FIGURE_SPECS",
    "FORMAT",
    "METRICS",
    "FidelityConfig",
    "FidelityError",
    "REFERENCE_EXACT",
    "REFERENCE_SET",
    "REFERENCE_SPANS_CRN",
    "REFERENCE_TOKENS",
    "REFERENCE_TOKENS_CRN",
    "attach_critic",
    "batch_fingerprint",
    "bootstrap_mean",
    "build_estimates",
    "check_policy",
    "claims",
    "complete_rows",
    "credit_spans",
    "critic_values",
    "format_claims",
    "format_table",
    "is_constant",
    "is_estimates_file",
    "load_estimates",
    "main",
    "mc_positions",
    "mixed_groups",
    "plot_responses",
    "prompt_rows",
    "response_rows",
    "rollouts_with_true_credit",
    "row_scores",
    "sample_batch",
    "sample_continuations",
    "score",
    "span_sums",
    "span_values",
    "spearman",
    "spearman_brown",
    "standard_errors",
    "token_credit",
    "top_weights",
    "trajectory_metrics",
]
