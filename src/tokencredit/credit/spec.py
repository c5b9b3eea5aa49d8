"""Credit specs: an estimator followed by any number of calibrators, e.g. ``"oppo+stare"``.

>>> credit = CreditPipeline("grpo+taco", taco={"lam": 0.5})
>>> out = credit(batch)            # CreditOutput with [B, T] advantages and metrics
>>> credit.required_signals        # frozenset({'logprobs', 'entropy'})

A bare calibrator name means the pairing of its paper (``"taco"`` is ``"grpo+taco"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch

from .batch import CreditBatch, CreditInputError
from .registry import CreditOutput, MethodInfo, get_method
from .ops import masked_fill_zero

__all__ = ["parse_spec", "CreditPipeline", "compute_credit", "credit_batch", "save_credit_state", "load_credit_state"]


def parse_spec(spec: str) -> List[MethodInfo]:
    """``"grpo+taco"`` -> [estimator grpo, calibrator taco]; ``"taco"`` -> its paper's pairing."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"credit spec: expected a string like 'grpo+taco', got {spec!r}")
    parts = [p.strip() for p in spec.split("+")]
    if any(not p for p in parts):
        raise ValueError(f"credit spec {spec!r}: empty method name between '+' signs")
    infos = [get_method(p) for p in parts]
    if infos[0].kind == "calibrator":
        infos.insert(0, get_method(infos[0].paired_with))
    for info in infos[1:]:
        if info.kind != "calibrator":
            raise ValueError(
                f"credit spec {spec!r}: '{info.name}' is an estimator; only the first method of a "
                f"spec may be an estimator, the rest must be calibrators"
            )
    names = [i.name for i in infos]
    if len(set(names)) != len(names):
        raise ValueError(f"credit spec {spec!r}: a method appears twice")
    return infos


class CreditPipeline:
    """A parsed credit spec with one config per method and the state of stateful methods.

    Configs are given by method name, as a dict of overrides or as the config dataclass:
    ``CreditPipeline("oppo+stare", oppo={"evidence_clip": 5.0}, stare=StareConfig(P=0.2))``.
    """

    def __init__(self, spec: str, configs: Dict[str, Any] | None = None, **by_name: Any):
        self.spec = spec
        self.methods = parse_spec(spec)
        self.name = "+".join(m.name for m in self.methods)
        given = dict(configs or {})
        overlap = set(given) & set(by_name)
        if overlap:
            raise ValueError(f"config for {sorted(overlap)} given twice")
        given.update(by_name)
        names = {m.name for m in self.methods}
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"configs given for {unknown}, which are not in credit spec '{self.name}'")
        self.configs = {m.name: m.make_config(given.get(m.name)) for m in self.methods}
        # each method with its requires resolved for its config (TACO's ar_lopti reads old_logprobs)
        self.methods = [m.bind(self.configs[m.name]) for m in self.methods]
        self.states = {m.name: m.state_cls(self.configs[m.name]) for m in self.methods if m.state_cls}

    @property
    def estimator(self) -> MethodInfo:
        return self.methods[0]

    @property
    def calibrators(self) -> List[MethodInfo]:
        return self.methods[1:]

    @property
    def required_signals(self) -> frozenset:
        out = set()
        for m in self.methods:
            out |= m.requires
        return frozenset(out)

    def loss_default(self, key: str) -> Any:
        """The loss setting ``key`` (``agg_mode``, ``norm_constant``) that the spec's methods
        declare (their papers' aggregation), or None when none declares it.

        Two methods that declare different values cannot both be honoured: a ``ValueError`` asks
        the user to choose (``dr_grpo+arca``: set ``loss.agg_mode``).
        """
        found = {m.name: m.loss_defaults[key] for m in self.methods if key in m.loss_defaults}
        if len(set(map(repr, found.values()))) > 1:
            said = ", ".join(f"{n} with {v!r}" for n, v in found.items())
            raise ValueError(f"credit spec '{self.name}': its methods are defined with different loss.{key} ({said}); set loss.{key} explicitly")
        return next(iter(found.values()), None)

    def __call__(self, batch: CreditBatch, *, update_state: bool = True) -> CreditOutput:
        """Credit for ``batch``: :meth:`estimate`, then :meth:`calibrate` (the two halves a
        distributed trainer runs apart, the driver and the workers).

        With ``update_state`` (call once per optimisation step) each stateful method's controller
        first takes one step from this batch, whose signals are measured before the update, and
        the credit is then computed with the updated state: the order of STARE's reference
        trainer (controller update, then the actor loss reads the new gate, W and M). The
        controller's metrics (``stare/W_next`` ...) are part of the returned metrics. With
        ``update_state=False`` the current state is used and left unchanged (replays).
        """
        if not isinstance(batch, CreditBatch):
            raise TypeError(f"batch: expected a CreditBatch, got {type(batch).__name__}")
        state_metrics = self.update_state(batch) if update_state else {}
        out = self.calibrate(batch, self.estimate(batch))
        out.metrics.update(state_metrics)
        return out

    def estimate(self, batch: CreditBatch, *, update_state: bool = False) -> CreditOutput:
        """The driver's half: with ``update_state`` the controllers' step (:meth:`update_state`),
        then the estimator's output as it returns it (its advantages, token weights, returns and
        metrics, the controllers' metrics after them). :meth:`calibrate` completes it."""
        if not isinstance(batch, CreditBatch):
            raise TypeError(f"batch: expected a CreditBatch, got {type(batch).__name__}")
        state_metrics = self.update_state(batch) if update_state else {}
        est = self.estimator
        batch.require(est.name, sorted(est.requires))
        out = est.fn(batch, self.configs[est.name])
        return CreditOutput(advantages=out.advantages, token_weights=out.token_weights, returns=out.returns,
                            metrics={**out.metrics, **state_metrics})

    def calibrate(self, batch: CreditBatch, estimated: CreditOutput | torch.Tensor) -> CreditOutput:
        """The workers' half: the calibrators, in order, on ``estimated`` (:meth:`estimate`'s
        output, or advantages [B, T] alone where the estimator ran elsewhere), reading the
        current state (never stepping it). Token weights are the product of the estimator's and
        every calibrator's; advantages and weights are 0 at masked positions."""
        if not isinstance(batch, CreditBatch):
            raise TypeError(f"batch: expected a CreditBatch, got {type(batch).__name__}")
        if isinstance(estimated, torch.Tensor):
            estimated = CreditOutput(advantages=estimated)
        adv, weights, metrics = estimated.advantages, estimated.token_weights, dict(estimated.metrics)
        for cal in self.calibrators:
            batch.require(cal.name, sorted(cal.requires))
            res = cal.fn(batch, adv, self.configs[cal.name], self.states.get(cal.name))
            adv = res.advantages
            metrics.update(res.metrics)
            if res.token_weights is not None:
                weights = res.token_weights if weights is None else weights * res.token_weights
        adv = masked_fill_zero(adv, batch.mask)
        if not torch.isfinite(adv).all():
            raise FloatingPointError(f"credit spec '{self.name}' produced non-finite advantages")
        if weights is not None:
            weights = masked_fill_zero(weights, batch.mask)
        return CreditOutput(advantages=adv, token_weights=weights, returns=estimated.returns, metrics=metrics)

    @property
    def calibrator_signals(self) -> frozenset:
        """The signals :meth:`calibrate` reads (the calibrators' declared ones)."""
        return frozenset().union(*(m.requires for m in self.calibrators))

    @property
    def state_signals(self) -> frozenset:
        """The signals the stateful methods' controllers read in :meth:`update_state`: each state
        class's ``requires`` (its method's when it declares none)."""
        out = set()
        for m in self.methods:
            if m.state_cls is not None:
                out |= set(getattr(m.state_cls, "requires", m.requires))
        return frozenset(out)

    def update_state(self, batch: CreditBatch) -> Dict[str, float]:
        """One controller step of every stateful method from ``batch`` (the step's batch, signals
        measured before the update); returns the controllers' metrics. ``__call__`` does this
        first unless told not to."""
        metrics: Dict[str, float] = {}
        for name, state in self.states.items():
            metrics.update(state.update(batch) or {})
        return metrics

    def state_dict(self) -> Dict[str, Any]:
        return {name: s.state_dict() for name, s in self.states.items()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        missing = sorted(set(self.states) - set(sd))
        extra = sorted(set(sd) - set(self.states))
        if missing or extra:
            raise KeyError(f"credit state for '{self.name}': missing {missing}, unexpected {extra}")
        for name, s in self.states.items():
            s.load_state_dict(sd[name])

    def __repr__(self) -> str:
        return f"CreditPipeline({self.name!r}, configs={self.configs!r})"


def credit_batch(response_mask: torch.Tensor, signals: Mapping[str, Optional[torch.Tensor]], *,
                 need: Optional[Iterable[str]] = None, rewards: Optional[torch.Tensor] = None,
                 group_ids: Optional[torch.Tensor] = None) -> CreditBatch:
    """A :class:`CreditBatch` of whatever signals a trainer has (by ``CreditBatch`` name): those
    in ``need`` (a pipeline's ``required_signals``, ``calibrator_signals`` or ``state_signals``;
    every given one when None), detached, floating ones as float32. ``rewards`` and
    ``group_ids`` default to zeros and one group a row: for the halves that read no outcome
    (calibrators, controllers that read batch statistics), never for an estimator. A needed
    signal the trainer lacks is left out: the method that reads it names it."""
    keep = None if need is None else set(need)
    B = response_mask.shape[0]
    dev = response_mask.device
    given = {}
    for k, v in signals.items():
        if v is None or (keep is not None and k not in keep):
            continue
        v = v.detach()
        given[k] = v.float() if v.is_floating_point() else v
    return CreditBatch(
        response_mask=response_mask,
        rewards=torch.zeros(B, dtype=torch.float32, device=dev) if rewards is None else rewards,
        group_ids=torch.arange(B, device=dev) if group_ids is None else group_ids,
        **given,
    )


def _state_to_json(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return {"__tensor__": x.detach().cpu().tolist(), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, dict):
        return {str(k): _state_to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_state_to_json(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    return x


def _state_from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tensor__", "dtype"}:
            return torch.tensor(x["__tensor__"], dtype=getattr(torch, x["dtype"]))
        return {k: _state_from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_state_from_json(v) for v in x]
    return x


def save_credit_state(path: str | Path, credit: CreditPipeline) -> Path:
    """The credit state of ``credit`` as the integrations' checkpoints keep it: a JSON file
    ``{"spec": name, "state": state_dict}`` (tensors as ``{"__tensor__": values, "dtype": ..}``),
    written whole (a temporary file renamed). The own trainer keeps the same ``state_dict`` in
    its checkpoint."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"spec": credit.name, "state": _state_to_json(credit.state_dict())}, f, indent=1)
    os.replace(tmp, p)
    return p


def load_credit_state(path: str | Path, credit: CreditPipeline) -> None:
    """Restore ``credit``'s state from a :func:`save_credit_state` file; a one-line ``ValueError``
    naming the file for another spec or a file that is not one."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a credit state file ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("state"), dict):
        raise ValueError(f"{path}: expected a JSON object with 'spec' and 'state' (a credit state file)")
    if d.get("spec") != credit.name:
        raise ValueError(f"{path}: credit state of spec '{d.get('spec')}', expected '{credit.name}' (this trainer's credit spec)")
    credit.load_state_dict(_state_from_json(d["state"]))


def compute_credit(spec: str, batch: CreditBatch, **configs: Any) -> CreditOutput:
    """One-shot credit for a stateless use: ``compute_credit("grpo+taco", batch, taco={"lam": .5})``."""
    return CreditPipeline(spec, **configs)(batch)

