"""Method registry: every credit method is a pure function registered by name.

Two kinds of method share one registry:

* an **estimator** turns outcomes (and values or oracle log-probs) into token advantages::

      fn(batch: CreditBatch, config) -> CreditOutput

* a **calibrator** reweights the advantages of any estimator from per-token signals::

      fn(batch: CreditBatch, advantages: Tensor[B, T], config, state) -> CreditOutput

  ``state`` is ``None`` unless the method registers a ``state_cls`` (STARE's controller).

A method declares the :class:`~tokencredit.batch.CreditBatch` fields it reads (``requires``),
so a trainer computes only those signals, and the loss aggregation its paper's estimator is
defined with (``loss_defaults``, e.g. ARCA's per-trajectory ``seq-mean-token-mean``), which a
trainer uses unless the user sets one. Provenance is one of ``ref-code`` (read in the
authors' code), ``paper`` (from the paper's text) or ``reconstructed`` (derived from the
paper's claims; see docs/methods.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Optional

from torch import Tensor

from .batch import SIGNALS

__all__ = [
    "CreditOutput",
    "MethodInfo",
    "register_estimator",
    "register_calibrator",
    "get_method",
    "list_methods",
    "PROVENANCE",
]

PROVENANCE = ("ref-code", "paper", "reconstructed")
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


def _register(info: MethodInfo) -> None:
    if info.name in _REGISTRY:
        raise ValueError(f"credit method '{info.name}' is already registered")
    if "+" in info.name or "," in info.name:
        raise ValueError(f"credit method name '{info.name}' may not contain '+' or ','")
    if info.provenance not in PROVENANCE:
        raise ValueError(f"{info.name}: provenance must be one of {PROVENANCE}, got {info.provenance!r}")
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
) -> Callable:
    """Decorator: register ``fn(batch, config) -> CreditOutput`` as estimator ``name``."""

    def deco(fn: Callable) -> Callable:
        _register(
            MethodInfo(
                name=name,
                kind="estimator",
                fn=fn,
                config_cls=config,
                requires=frozenset(requires),
                provenance=provenance,
                summary=summary,
                needs_groups=needs_groups,
                loss_defaults=dict(loss_defaults or {}),
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
) -> Callable:
    """Decorator: register ``fn(batch, advantages, config, state) -> CreditOutput``."""

    def deco(fn: Callable) -> Callable:
        _register(
            MethodInfo(
                name=name,
                kind="calibrator",
                fn=fn,
                config_cls=config,
                requires=frozenset(requires),
                provenance=provenance,
                summary=summary,
                paired_with=paired_with,
                state_cls=state_cls,
                loss_defaults=dict(loss_defaults or {}),
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
        raise KeyError(f"unknown credit method '{name}'; registered: {sorted(_REGISTRY)}") from None


def list_methods(kind: Optional[str] = None) -> list:
    """Names of registered methods, optionally of one kind ("estimator" or "calibrator")."""
    _ensure_loaded()
    if kind not in (None, "estimator", "calibrator"):
        raise ValueError(f"kind: expected None, 'estimator' or 'calibrator', got {kind!r}")
    return sorted(n for n, i in _REGISTRY.items() if kind is None or i.kind == kind)
