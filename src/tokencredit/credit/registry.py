"""Method registry: every credit method is a pure function registered by name.

Two kinds of method share one registry:

* an **estimator** turns outcomes (and values or oracle log-probs) into token advantages::

      fn(batch: CreditBatch, config) -> CreditOutput

* a **calibrator** reweights the advantages of any estimator from per-token signals::

      fn(batch: CreditBatch, advantages: Tensor[B, T], config, state) -> CreditOutput

  ``state`` is ``None`` unless the method registers a ``state_cls`` (STARE's controller).

A method declares the :class:`~tokencredit.credit.batch.CreditBatch` fields it reads (``requires``:
the names, or a function of its config when a mode reads more, e.g. TACO's ``ar_lopti``), so a
trainer computes only those signals, and the loss aggregation its paper's estimator is
defined with (``loss_defaults``, e.g. ARCA's per-trajectory ``seq-mean-token-mean``), which a
trainer uses unless the user sets one. Provenance is one of ``ref-code`` (read in the
authors' code), ``paper`` (from the paper's text) or ``reconstructed`` (derived from the
paper's claims; see docs/methods.md).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Optional

import torch
from torch import Tensor

from .batch import SIGNALS
from ..errors import UnknownMethodError  # noqa: F401 (defined in errors; importable here too)

__all__ = [
    "CreditOutput",
    "OraclePass",
    "CriticSpec",
    "ContinuationPass",
    "SaliencyPass",
    "MethodInfo",
    "register_estimator",
    "register_calibrator",
    "get_method",
    "list_methods",
    "default_oracle",
    "PROVENANCE",
    "UnknownMethodError",
]

from .provenance import PROVENANCE  # noqa: E402 (re-exported)
#: the loss settings a method may declare defaults for
LOSS_DEFAULT_KEYS = ("agg_mode", "norm_constant")


@dataclass
class CreditOutput:
    """What a credit method returns.

    advantages: [B, T] token advantages, exactly 0 at masked positions.
    token_weights: optional [B, T] multiplicative credit weights w_t *already folded into*
        ``advantages`` (for a calibrator, ``advantages = w * input advantages`` wherever the
        input is changed); kept for diagnostics (Gini, effective-token ratio). Not a loss weight.
    returns: optional [B, T] value targets (GAE-style estimators).
    metrics: flat, namespaced scalars, e.g. ``{"taco/weight_mean": 0.93}``.
    """

    advantages: Tensor
    token_weights: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OraclePass:
    """An extra forward pass a method declares: the batch's own responses scored by another
    model, or by the policy under another prompt; its log-probs become ``oracle_logprobs``.

    prompt: ``(question, answer) -> str``, the user message the scorer sees instead of the
        question (OPPO's oracle prompt with the reference answer); None: the student's own prompt
        (on-policy distillation from a teacher).
    scorer: ``"policy"`` (self-oracle) or ``"teacher"`` (a frozen model the user supplies; a
        trainer without one refuses the spec).
    """

    prompt: Optional[Callable[[str, str], str]]
    scorer: str

    def __post_init__(self):
        if self.scorer not in ("policy", "teacher"):
            raise ValueError(f"OraclePass scorer: expected 'policy' or 'teacher', got {self.scorer!r}")
        if self.prompt is None and self.scorer == "policy":
            raise ValueError("OraclePass: the policy on its own prompt is the policy pass; give a prompt or a teacher")


@dataclass(frozen=True)
class CriticSpec:
    """The critic a method declares: a value head on the policy's final hidden states.

    transform: ``"identity"`` (values are the head's output) or ``"sigmoid"`` (a probability).
    loss: ``(head_out [B, T], *, rewards [B], returns [B, T] | None, mask [B, T], weights [B, T] | None)
        -> scalar``, on the head's raw output (before ``transform``).
    after_actor: train after the actor step on a forward of the *updated* actor (its hidden
        states), each sample weighted by ``is_weights(new_logprobs, old_logprobs, mask)``.
    """

    transform: str
    loss: Callable[..., Tensor]
    after_actor: bool = False
    is_weights: Optional[Callable[[Tensor, Tensor, Tensor], Tensor]] = None

    def __post_init__(self):
        if self.transform not in ("identity", "sigmoid"):
            raise ValueError(f"CriticSpec transform: expected 'identity' or 'sigmoid', got {self.transform!r}")
        if self.after_actor and self.is_weights is None:
            raise ValueError("CriticSpec: after_actor needs is_weights")


@dataclass(frozen=True)
class ContinuationPass:
    """Monte Carlo continuations a method declares: each response is cut into steps, and ``k``
    fresh continuations are sampled from the current policy after each step's prefix and
    scored by the task's reward; their mean becomes ``mc_values`` (and the cuts ``step_starts``).

    cuts: ``(token_texts, logprobs) -> [p_0 = 0, p_1, ...]``, the token positions where the
        steps start, from each response token's decoded text (and its policy log-probs
        ``[T_row]``, for a cut rule that reads them, e.g. SPO's probability-based cut points;
        None when the plan has no policy pass). One call per response.
    k: continuations per prefix. max_steps: the prefixes of steps past this index are not
        sampled (their value is left to the method; None: every step's).
    reads_logprobs: the cut rule reads the log-probs, so a trainer runs the policy pass before
        the continuations (the update's own forward, which comes after, cannot give them).
    """

    cuts: Callable[[Any, Any], Any]
    k: int
    max_steps: Optional[int] = None
    reads_logprobs: bool = False

    def __post_init__(self):
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"ContinuationPass k: expected an int >= 1, got {self.k!r}")
        if self.max_steps is not None and not (isinstance(self.max_steps, int) and self.max_steps >= 0):
            raise ValueError(f"ContinuationPass max_steps: expected None or an int >= 0, got {self.max_steps!r}")


@dataclass(frozen=True)
class SaliencyPass:
    """An input-gradient pass a method declares (OAR-G): how much each response token's input
    embedding moves the policy's predicted outcome; its result is ``outcome_saliency``.

    The last ``answer_tokens`` tokens of each response are its outcome, the tokens before them
    its reasoning. With Gaussian noise of std ``noise_std`` on the reasoning tokens' input
    embeddings e_t, J = KL(p_0 || p_noisy) of the mean next-token logits at the positions that
    predict the outcome tokens (clean p_0, ``kl_eps`` inside its log), and the saliency of a
    reasoning token is |<dJ/de_t, e_t>|; the outcome tokens' saliency is 0. One forward without
    grad and one with a backward to the input embeddings only (no parameter gradient is kept).
    """

    answer_tokens: int = 1
    noise_std: float = 1e-3
    kl_eps: float = 1e-12

    def __post_init__(self):
        if not (isinstance(self.answer_tokens, int) and not isinstance(self.answer_tokens, bool) and self.answer_tokens >= 1):
            raise ValueError(f"SaliencyPass answer_tokens: expected an int >= 1, got {self.answer_tokens!r}")
        for k in ("noise_std", "kl_eps"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and v == v and v != float("inf")):
                raise ValueError(f"SaliencyPass {k}: expected a finite number >= 0, got {v!r}")

    def split(self, response_mask: Tensor):
        """``(reasoning, outcome)`` bool masks [B, T] of right-padded responses: the last
        ``answer_tokens`` valid tokens of each response are its outcome, the valid ones before
        them its reasoning (a response of at most ``answer_tokens`` tokens has no reasoning)."""
        m = response_mask.bool()
        cut = m.sum(-1, keepdim=True) - self.answer_tokens
        t = torch.arange(m.shape[-1], device=m.device)[None, :]
        return m & (t < cut), m & (t >= cut)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    kind: str  # "estimator" | "calibrator"
    fn: Callable[..., CreditOutput]
    config_cls: type
    requires: FrozenSet[str]
    provenance: str
    summary: str
    needs_groups: bool = False
    paired_with: Optional[str] = None  # calibrators: the estimator of the method's paper
    state_cls: Optional[type] = None
    # loss settings the method's paper pairs it with ({"agg_mode": ..., "norm_constant": ...});
    # a trainer applies them where the user left the setting unset. norm_constant may be the
    # string "max_new_tokens" (the generation budget, Dr. GRPO's constant).
    loss_defaults: Dict[str, Any] = field(default_factory=dict)
    # extra passes and models, each a function of the method's config (None: not needed)
    oracle: Optional[Callable[[Any], Optional[OraclePass]]] = None
    critic: Optional[Callable[[Any], CriticSpec]] = None
    continuations: Optional[Callable[[Any], ContinuationPass]] = None
    saliency: Optional[Callable[[Any], SaliencyPass]] = None
    # the method reads an adapter's effect (ARCA's residual): a model without a LoRA adapter is an error
    needs_adapter: bool = False
    # when the signals read depend on the config (TACO's ar_lopti mode reads old_logprobs):
    # config -> signals; ``requires`` is then the default config's, and a pipeline binds each
    # method to its config (:meth:`bind`)
    requires_fn: Optional[Callable[[Any], Any]] = None

    def bind(self, config: Any) -> "MethodInfo":
        """This method with ``requires`` resolved for ``config`` (itself when it does not depend on it)."""
        if self.requires_fn is None:
            return self
        return dataclasses.replace(self, requires=_signals(self.name, self.requires_fn(config)))

    def make_config(self, config: Any = None) -> Any:
        """Build this method's config from None, a dict of overrides, or a config instance."""
        if config is None:
            return self.config_cls()
        if isinstance(config, self.config_cls):
            return config
        if isinstance(config, dict):
            names = {f.name for f in dataclasses.fields(self.config_cls)}
            unknown = sorted(set(config) - names)
            if unknown:
                raise ValueError(
                    f"{self.name} config: unknown key(s) {unknown}; expected some of {sorted(names)}"
                )
            return self.config_cls(**config)
        raise TypeError(
            f"{self.name} config: expected None, a dict or {self.config_cls.__name__}, got {type(config).__name__}"
        )


_REGISTRY: Dict[str, MethodInfo] = {}


def _signals(name: str, requires: Any) -> FrozenSet[str]:
    out = frozenset(requires)
    unknown = set(out) - set(SIGNALS)
    if unknown:
        raise ValueError(f"{name}: requires unknown signal(s) {sorted(unknown)}; known: {SIGNALS}")
    return out


def _requires(name: str, requires: Any, config_cls: type):
    """``requires`` as declared: signals, or a function of the config (-> the default config's signals, the function)."""
    if callable(requires):
        return _signals(name, requires(config_cls())), requires
    return _signals(name, requires), None


def _checking_signals(fn: Callable, name: str, req: FrozenSet[str], req_fn, config_pos: int) -> Callable:
    """``fn`` that first checks the batch holds the signals its registration declares (for the
    config it is called with), so a method states what it reads once, in its decorator, and a
    direct call fails as a pipeline's would: ``CreditInputError`` naming the missing field."""

    @functools.wraps(fn)
    def checked(batch, *args, **kwargs):
        config = args[config_pos - 1] if len(args) >= config_pos else kwargs.get("config")
        needs = req if req_fn is None or config is None else _signals(name, req_fn(config))
        batch.require(name if needs == req else _with_settings(name, config), sorted(needs))
        return fn(batch, *args, **kwargs)

    return checked


def _with_settings(name: str, config: Any) -> str:
    """``name`` with the settings where ``config`` differs from its defaults, e.g. "taco
    (mode='ar_lopti')": a signal read only under a setting is named with that setting."""
    try:
        default = type(config)()
        diffs = [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                 if getattr(config, f.name) != getattr(default, f.name)]
    except (TypeError, ValueError):
        return name
    return f"{name} ({', '.join(diffs)})" if diffs else name


def _register(info: MethodInfo) -> None:
    if info.name in _REGISTRY:
        raise ValueError(f"credit method '{info.name}' is already registered")
    if "+" in info.name or "," in info.name:
        raise ValueError(f"credit method name '{info.name}' may not contain '+' or ','")
    if info.provenance not in PROVENANCE:
        raise ValueError(f"{info.name}: provenance must be one of {PROVENANCE}, got {info.provenance!r}")
    if "oracle_logprobs" in info.requires and info.oracle is None:
        raise ValueError(f"{info.name}: requires oracle_logprobs but declares no oracle pass (oracle=...)")
    if "values" in info.requires and info.critic is None:
        raise ValueError(f"{info.name}: requires values but declares no critic (critic=...)")
    if {"mc_values", "step_starts"} & set(info.requires) and info.continuations is None:
        raise ValueError(f"{info.name}: requires mc_values / step_starts but declares no continuation pass (continuations=...)")
    if "outcome_saliency" in info.requires and info.saliency is None:
        raise ValueError(f"{info.name}: requires outcome_saliency but declares no saliency pass (saliency=...)")
    unknown = set(info.requires) - set(SIGNALS)
    if unknown:
        raise ValueError(f"{info.name}: requires unknown signal(s) {sorted(unknown)}; known: {SIGNALS}")
    bad = sorted(set(info.loss_defaults) - set(LOSS_DEFAULT_KEYS))
    if bad:
        raise ValueError(f"{info.name}: loss_defaults: unknown key(s) {bad}; expected some of {list(LOSS_DEFAULT_KEYS)}")
    if not dataclasses.is_dataclass(info.config_cls):
        raise TypeError(f"{info.name}: config_cls must be a dataclass")
    _REGISTRY[info.name] = info


def register_estimator(
    name: str,
    *,
    config: type,
    requires=(),
    provenance: str,
    summary: str,
    needs_groups: bool = False,
    loss_defaults: Optional[Dict[str, Any]] = None,
    oracle: Optional[Callable[[Any], Optional[OraclePass]]] = None,
    critic: Optional[Callable[[Any], CriticSpec]] = None,
    continuations: Optional[Callable[[Any], ContinuationPass]] = None,
) -> Callable:
    """Decorator: register ``fn(batch, config) -> CreditOutput`` as estimator ``name``."""

    def deco(fn: Callable) -> Callable:
        req, req_fn = _requires(name, requires, config)
        fn = _checking_signals(fn, name, req, req_fn, config_pos=1)
        _register(
            MethodInfo(
                name=name,
                kind="estimator",
                fn=fn,
                config_cls=config,
                requires=req,
                requires_fn=req_fn,
                provenance=provenance,
                summary=summary,
                needs_groups=needs_groups,
                loss_defaults=dict(loss_defaults or {}),
                oracle=oracle,
                critic=critic,
                continuations=continuations,
            )
        )
        return fn

    return deco


def register_calibrator(
    name: str,
    *,
    config: type,
    requires=(),
    provenance: str,
    summary: str,
    paired_with: str = "grpo",
    state_cls: Optional[type] = None,
    loss_defaults: Optional[Dict[str, Any]] = None,
    needs_adapter: bool = False,
    saliency: Optional[Callable[[Any], SaliencyPass]] = None,
) -> Callable:
    """Decorator: register ``fn(batch, advantages, config, state) -> CreditOutput``."""

    def deco(fn: Callable) -> Callable:
        req, req_fn = _requires(name, requires, config)
        fn = _checking_signals(fn, name, req, req_fn, config_pos=2)
        _register(
            MethodInfo(
                name=name,
                kind="calibrator",
                fn=fn,
                config_cls=config,
                requires=req,
                requires_fn=req_fn,
                provenance=provenance,
                summary=summary,
                paired_with=paired_with,
                state_cls=state_cls,
                loss_defaults=dict(loss_defaults or {}),
                needs_adapter=needs_adapter,
                saliency=saliency,
            )
        )
        return fn

    return deco


def _ensure_loaded() -> None:
    # importing the methods package registers every built-in method
    from . import methods  # noqa: F401


def get_method(name: str) -> MethodInfo:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(f"unknown credit method '{name}'; registered: {sorted(_REGISTRY)}") from None


def list_methods(kind: Optional[str] = None) -> list:
    """Names of registered methods, optionally of one kind ("estimator" or "calibrator")."""
    _ensure_loaded()
    if kind not in (None, "estimator", "calibrator"):
        raise ValueError(f"kind: expected None, 'estimator' or 'calibrator', got {kind!r}")
    return sorted(n for n, i in _REGISTRY.items() if kind is None or i.kind == kind)


def default_oracle() -> Optional[OraclePass]:
    """The oracle pass for a batch that should carry ``oracle_logprobs`` although no method of
    its spec declares one (a trainer's saved eval batch, so that ``inspect`` can replay the
    oracle methods on it): the policy-scored pass that the first registered estimator reading
    ``oracle_logprobs`` declares at its default config (the built-in methods register first).
    None when no registered method declares one."""
    _ensure_loaded()
    for info in _REGISTRY.values():
        if info.oracle is None or "oracle_logprobs" not in info.requires:
            continue
        declared = info.oracle(info.config_cls())
        if declared is not None and declared.scorer == "policy":
            return declared
    return None
