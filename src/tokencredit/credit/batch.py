"""The credit contract: one typed batch of per-token signals.

Every trainer (ours, TRL, verl) fills a :class:`CreditBatch` and every credit method reads
one. Validation happens once, here, so that methods can assume clean input: shapes agree,
the mask is 0/1, and every signal is finite wherever the mask is 1. Padding positions may hold
anything (NaN included): methods never read them.

Shapes (B responses, padded to T response tokens):

=================  =========  ===========================================================
field              shape      meaning
=================  =========  ===========================================================
response_mask      [B, T]     1 on real response tokens, 0 on padding (bool, int or float)
rewards            [B]        scalar outcome reward per response
group_ids          [B]        integer id of the prompt each response answers
logprobs           [B, T]     log pi_theta(y_t | h_t) of the current policy
old_logprobs       [B, T]     behaviour-policy log-probs (from the rollout)
ref_logprobs       [B, T]     frozen reference-policy log-probs
entropy            [B, T]     full-vocabulary entropy of the next-token distribution
mode_prob          [B, T]     top-1 probability of the next-token distribution
hidden_residual    [B, T]     ARCA salience ||h_adapted - h_base||_2 (>= 0)
oracle_logprobs    [B, T]     log-probs of y_t under the oracle-prompted (or teacher) model
true_values        [B, T]     the current policy's exact value V(h_t) of the state before token t
                              (enumerated on a task with a response space: exactvalue)
sum_pi_squared     [B, T]     sum_v pi_v^2 of the next-token distribution (its collision
                              probability; verl's sum_pi_squared, OTB's variance proxy)
mc_values          [B, T]     Monte Carlo value of the state before the step containing token t:
                              the mean reward of K continuations sampled from that step's
                              prefix (the continuation pass: continuations; VinePPO)
step_starts        [B, T]     1 on the first token of each step the continuation pass cut the
                              response into, 0 elsewhere
values             [B, T + 1] critic values; values[:, t] = V(h_t), the state before token t
token_ids          [B, T]     the sampled token ids y_t (integers >= 0 on valid positions;
                              an integer or a floating-point tensor: KTAE's token statistics)
outcome_saliency   [B, T]     OAR-G's input-gradient saliency of token t for the response's outcome
                              (its last tokens' predicted distribution; >= 0; the saliency pass)
planning_mask      [B, T]     1 on planning tokens (strategic-gram matches of the decoded
                              response, HICRA / SEPA), 0 on execution tokens
=================  =========  ===========================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..errors import CreditInputError  # noqa: F401 (defined in errors; importable here too)

__all__ = ["CreditBatch", "CreditInputError", "TOKEN_SIGNALS", "SIGNALS"]


#: optional per-token signals of shape [B, T]
TOKEN_SIGNALS = (
    "logprobs",
    "old_logprobs",
    "ref_logprobs",
    "entropy",
    "mode_prob",
    "hidden_residual",
    "oracle_logprobs",
    "true_values",
    "sum_pi_squared",
    "mc_values",
    "step_starts",
    "outcome_saliency",
)
#: every optional signal a method may declare (token_ids: the rollout's own tokens, no model pass)
SIGNALS = TOKEN_SIGNALS + ("values", "token_ids", "planning_mask")


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:200]


@dataclass(frozen=True)
class CreditBatch:
    """A validated batch of responses and the per-token signals a credit method may need."""

    response_mask: Tensor
    rewards: Tensor
    group_ids: Tensor
    logprobs: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    mode_prob: Optional[Tensor] = None
    hidden_residual: Optional[Tensor] = None
    oracle_logprobs: Optional[Tensor] = None
    true_values: Optional[Tensor] = None
    values: Optional[Tensor] = None
    token_ids: Optional[Tensor] = None
    planning_mask: Optional[Tensor] = None
    sum_pi_squared: Optional[Tensor] = None
    mc_values: Optional[Tensor] = None
    step_starts: Optional[Tensor] = None
    outcome_saliency: Optional[Tensor] = None
    # derived on construction, not passed by callers
    mask: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        m = self.response_mask
        if not isinstance(m, Tensor):
            raise CreditInputError(f"response_mask: expected a torch.Tensor of shape [B, T], got {_describe(m)}")
        if m.dim() != 2:
            raise CreditInputError(f"response_mask: expected 2 dims [B, T], got shape {tuple(m.shape)}")
        B, T = m.shape
        if B == 0:
            raise CreditInputError("response_mask: expected at least one response (B >= 1), got B = 0")
        if T == 0:
            raise CreditInputError("response_mask: expected at least one token position (T >= 1), got T = 0")
        if m.is_floating_point() or m.is_complex():
            bad = ~((m == 0) | (m == 1))
        elif m.dtype == torch.bool:
            bad = torch.zeros_like(m, dtype=torch.bool)
        else:
            bad = ~((m == 0) | (m == 1))
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise CreditInputError(
                f"response_mask: expected only 0/1 values, got {m[idx].item()!r} at position {idx}"
            )
        bool_mask = m.bool()
        object.__setattr__(self, "mask", bool_mask)

        r = self.rewards
        if not isinstance(r, Tensor) or r.shape != (B,):
            raise CreditInputError(f"rewards: expected a tensor of shape ({B},), got {_describe(r)}")
        if not r.is_floating_point():
            raise CreditInputError(f"rewards: expected a floating-point tensor, got dtype {r.dtype}")
        if not torch.isfinite(r).all():
            i = int((~torch.isfinite(r)).nonzero()[0])
            raise CreditInputError(f"rewards: expected finite values, got {r[i].item()} at index {i}")

        g = self.group_ids
        if not isinstance(g, Tensor) or g.shape != (B,):
            raise CreditInputError(f"group_ids: expected a tensor of shape ({B},), got {_describe(g)}")
        if g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
            raise CreditInputError(f"group_ids: expected an integer tensor, got dtype {g.dtype}")

        for name in TOKEN_SIGNALS:
            x = getattr(self, name)
            if x is None:
                continue
            self._check_signal(name, x, (B, T), bool_mask)
        if self.values is not None:
            # V(h_t) is read for every valid token t; the value after the last token is not
            # read (the terminal state's value is the outcome itself), so it is not checked.
            self._check_signal("values", self.values, (B, T + 1), None)
            v = self.values[:, :T]
            badv = bool_mask & ~torch.isfinite(v)
            if badv.any():
                idx = tuple(int(i) for i in badv.nonzero()[0])
                raise CreditInputError(f"values: expected finite values on valid positions, got {v[idx].item()} at {idx}")
        if self.token_ids is not None:
            self._check_token_ids(self.token_ids, (B, T), bool_mask)
        if self.planning_mask is not None:
            pm = self.planning_mask
            if not isinstance(pm, Tensor) or tuple(pm.shape) != (B, T):
                raise CreditInputError(f"planning_mask: expected a tensor of shape {(B, T)}, got {_describe(pm)}")
            badp = bool_mask & ~((pm == 0) | (pm == 1))
            if badp.any():
                idx = tuple(int(i) for i in badp.nonzero()[0])
                raise CreditInputError(f"planning_mask: expected 0/1 on valid positions, got {pm[idx].item()!r} at {idx}")
        for name in ("hidden_residual", "outcome_saliency"):  # magnitudes
            x = getattr(self, name)
            neg = None if x is None else bool_mask & (x < 0)
            if neg is not None and neg.any():
                idx = tuple(int(i) for i in neg.nonzero()[0])
                raise CreditInputError(f"{name}: expected a magnitude (>= 0), got {x[idx].item()} at {idx}")
        for name in ("mode_prob", "sum_pi_squared"):  # probabilities
            x = getattr(self, name)
            out = None if x is None else bool_mask & ((x < 0) | (x > 1))
            if out is not None and out.any():
                idx = tuple(int(i) for i in out.nonzero()[0])
                raise CreditInputError(f"{name}: expected a probability in [0, 1], got {x[idx].item()} at {idx}")

    @staticmethod
    def _check_token_ids(x: object, shape: tuple, bool_mask: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise CreditInputError(f"token_ids: expected a tensor of shape {shape}, got {_describe(x)}")
        if tuple(x.shape) != shape:
            raise CreditInputError(f"token_ids: expected shape {shape}, got {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_complex():
            raise CreditInputError(f"token_ids: expected integer token ids, got dtype {x.dtype}")
        v = x[bool_mask]
        bad = ~torch.isfinite(v) | (v < 0) | (v != v.round()) if x.is_floating_point() else v < 0
        if bad.any():
            idx = tuple(int(i) for i in bool_mask.nonzero()[int(bad.nonzero()[0])])
            raise CreditInputError(
                f"token_ids: expected integer token ids >= 0 on valid (mask = 1) positions, got {x[idx].item()} at {idx}"
            )

    @staticmethod
    def _check_signal(name: str, x: object, shape: tuple, bool_mask: Optional[Tensor]) -> None:
        if not isinstance(x, Tensor):
            raise CreditInputError(f"{name}: expected a tensor of shape {shape}, got {_describe(x)}")
        if tuple(x.shape) != shape:
            raise CreditInputError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise CreditInputError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
        if bool_mask is not None:
            bad = bool_mask & ~torch.isfinite(x)
            if bad.any():
                idx = tuple(int(i) for i in bad.nonzero()[0])
                raise CreditInputError(
                    f"{name}: expected finite values on valid (mask = 1) positions, got {x[idx].item()} at {idx}"
                )

    # -- conveniences -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.response_mask.shape[0])

    @property
    def num_positions(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def fmask(self) -> Tensor:
        """The mask as floats in the rewards' dtype."""
        return self.mask.to(self.rewards.dtype)

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(dim=1)

    def require(self, method: str, names) -> None:
        """Raise a clear error if any of ``names`` is missing for ``method``."""
        for name in names:
            if getattr(self, name) is None:
                raise CreditInputError(
                    f"{name}: method '{method}' needs this signal, but CreditBatch.{name} is None"
                )

    def replace(self, **changes) -> "CreditBatch":
        """A copy with some fields replaced (validated again)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        kw.update(changes)
        return CreditBatch(**kw)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
