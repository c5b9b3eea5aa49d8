"""The saved-rollouts format: one training batch with its signals and credit, as
``eval/rollouts_step_XXXXXXXX.pt`` holds it, and the replay of that batch.

Every trainer writes it (the own trainer through :func:`tokencredit.train.evaluation.rollouts_record`,
``TokenCreditGRPOTrainer`` with each checkpoint, the verl plugin's driver with each checkpoint);
``tokencredit inspect`` (:mod:`tokencredit.analysis.inspector`, the page) and ``tokencredit fidelity``
read it. :class:`RolloutsRecord` owns the format: :meth:`RolloutsRecord.build` from a trainer's
batch and credit, :meth:`~RolloutsRecord.save` (``torch.save`` of plain tensors, strings and
numbers), :meth:`~RolloutsRecord.load` (``torch.load(weights_only=True)``, then
:func:`check_rollouts`: one-line ``ValueError`` naming the field), :meth:`~RolloutsRecord.replay`.

The file is a dict with these keys (readers use the dict; :data:`RECORD_KEYS`):

* ``credit`` (the spec, e.g. ``"grpo+taco"``), ``credit_configs`` (each method's config as a
  dict), ``credit_state`` (the spec's state after the step: STARE's controller, ...), ``step``;
* ``signals``: the :class:`~tokencredit.credit.batch.CreditBatch` fields the step had (tensors; at least
  ``response_mask`` [B, T], ``rewards`` [B], ``group_ids`` [B]);
* ``advantages`` [B, T] and ``token_weights`` [B, T] or None: the credit the run trained on;
* ``response_ids`` [B, T'], ``tokens`` (each response's decoded tokens at its valid positions),
  ``texts``, ``questions``;
* other keys are kept as they are (``reference_rows`` of a fidelity estimates file,
  ``prompt_ids``/``prompt_mask``/``messages`` of a sampled batch).

:func:`replay` recomputes credit on exactly the saved batch with every requested spec whose
required signals the batch has (the run's own method configs and state for the methods the run
used), so methods are compared on identical rollouts; the others are reported with the signals
they lack.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from ..credit.batch import SIGNALS, CreditBatch
from ..credit.registry import CreditOutput

__all__ = [
    "COMPOSITIONS",
    "RECORD_KEYS",
    "RolloutsRecord",
    "MethodView",
    "Skipped",
    "Inspection",
    "find_rollouts",
    "load_rollouts",
    "check_rollouts",
    "saved_batch",
    "available_signals",
    "default_specs",
    "parse_methods",
    "replay",
]

#: the keys of a rollouts file, in the order the writers write them
RECORD_KEYS = ("credit", "credit_configs", "credit_state", "step", "signals", "advantages", "token_weights",
               "response_ids", "tokens", "texts", "questions")

#: compositions tried by default besides every registered spec
COMPOSITIONS = ("rloo+taco", "rloo+stare", "dr_grpo+taco", "oppo+stare", "oppo+taco", "rloo+arca", "grpo+taco+stare")

_REQUIRED_KEYS = ("signals", "tokens")


def _cpu(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().cpu()


@dataclass
class RolloutsRecord:
    """One saved training batch (the fields of :data:`RECORD_KEYS`; ``extra``: any other key)."""

    signals: Dict[str, torch.Tensor]
    tokens: List[List[str]]
    credit: Optional[str] = None
    credit_configs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    credit_state: Dict[str, Any] = field(default_factory=dict)
    step: Optional[int] = None
    advantages: Optional[torch.Tensor] = None
    token_weights: Optional[torch.Tensor] = None
    response_ids: Optional[torch.Tensor] = None
    texts: List[str] = field(default_factory=list)
    questions: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, credit, batch: CreditBatch | Mapping[str, Any], output, *, response_ids: torch.Tensor, tokenizer,
              questions: Sequence[str], step: int, texts: Optional[Sequence[str]] = None,
              credit_state: Optional[Dict[str, Any]] = None) -> "RolloutsRecord":
        """The record of one step of any trainer. ``credit``: the run's ``CreditPipeline`` (its
        name, configs and, unless ``credit_state`` is given, its state now); ``batch``: the
        step's :class:`CreditBatch` or its signals as a dict; ``output``: the credit the run
        trained on (``.advantages``, ``.token_weights``); ``response_ids`` [B, T'] (decoded at the
        valid positions of ``response_mask`` into ``tokens``, and into ``texts`` unless given);
        ``questions``: one per response."""
        sig = batch.to_dict() if isinstance(batch, CreditBatch) else dict(batch)
        signals = {k: v.detach().cpu() for k, v in sig.items() if isinstance(v, torch.Tensor)}
        ids = response_ids.detach().cpu().long()
        mask = signals["response_mask"].bool()
        decode = tokenizer.decode
        tokens = [[decode([int(t)]) for t, m in zip(row, mrow) if m] for row, mrow in zip(ids, mask)]
        if texts is None:
            texts = [decode([int(t) for t, m in zip(row, mrow) if m], skip_special_tokens=True) for row, mrow in zip(ids, mask)]
        record = cls(
            signals=signals,
            tokens=tokens,
            credit=credit.name,
            # the run's method settings and state (STARE's controller, ...), so that a replay of
            # this batch computes the credit the run computed
            credit_configs={name: dataclasses.asdict(c) for name, c in credit.configs.items()},
            credit_state=copy.deepcopy(credit.state_dict()) if credit_state is None else credit_state,
            step=int(step),
            advantages=_cpu(output.advantages),
            token_weights=_cpu(getattr(output, "token_weights", None)),
            response_ids=ids,
            texts=list(texts),
            questions=[str(q) for q in questions],
        )
        record.check()
        return record

    # -- the file ----------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The file's content: plain tensors, strings and numbers (readable with weights_only)."""
        return {**{k: getattr(self, k) for k in RECORD_KEYS}, **self.extra}

    @classmethod
    def from_dict(cls, saved: Any, where: str = "rollouts") -> "RolloutsRecord":
        """A record of a file's dict, checked (:func:`check_rollouts`)."""
        check_rollouts(saved, where)
        known = {k: saved[k] for k in RECORD_KEYS if k in saved and saved[k] is not None}
        return cls(**known, extra={k: v for k, v in saved.items() if k not in RECORD_KEYS})

    def check(self, where: str = "rollouts") -> None:
        check_rollouts(self.to_dict(), where)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.to_dict(), p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> "RolloutsRecord":
        """A rollouts file, or the latest ``eval/rollouts_step_*.pt`` of a run directory."""
        p = find_rollouts(path)
        return cls.from_dict(_load(p), str(p))

    # -- the batch ---------------------------------------------------------------------------
    def credit_batch(self) -> CreditBatch:
        return saved_batch(self.to_dict())

    def replay(self, specs: Optional[Sequence[str]] = None, *, credit_args: Sequence[str] = (),
               include_saved: bool = True) -> "Inspection":
        return replay(self.to_dict(), specs, credit_args=credit_args, include_saved=include_saved)


@dataclass
class MethodView:
    """Credit of one method on the saved batch."""

    label: str  # what the page shows: the canonical spec, or "<spec> (as trained)"
    spec: str
    source: str  # "replayed" | "saved"
    advantages: torch.Tensor  # [B, T]
    token_weights: Optional[torch.Tensor]
    diagnostics: Dict[str, float]


@dataclass
class Skipped:
    spec: str
    missing: List[str] = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class Inspection:
    views: List[MethodView]
    skipped: List[Skipped]
    available: List[str]


# ---------------------------------------------------------------------------------------
# loading


def find_rollouts(path: str | Path) -> Path:
    """A rollouts file itself, or the latest ``eval/rollouts_step_*.pt`` of a run directory."""
    p = Path(path)
    if p.is_dir():
        found = sorted((p / "eval").glob("rollouts_step_*.pt")) or sorted(p.glob("rollouts_step_*.pt"))
        if not found:
            raise FileNotFoundError(f"ROLLOUTS: no eval/rollouts_step_*.pt under run directory {p}")
        return found[-1]
    if not p.exists():
        raise FileNotFoundError(f"ROLLOUTS: no such file {p}")
    return p


def _load(p: Path) -> Any:
    try:
        saved = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise ValueError(f"ROLLOUTS: {p} is not a tokencredit rollouts file ({type(e).__name__}: {e})") from None
    if isinstance(saved, dict) and isinstance(saved.get("format"), str) and "signals" not in saved:
        raise ValueError(
            f"ROLLOUTS: {p} is a {saved['format']!r} file, not a rollouts file; `tokencredit inspect` opens it "
            f"(with its reference rows), the library reads it with that format's own loader"
        )
    return saved


def load_rollouts(path: str | Path) -> Dict[str, Any]:
    """Load and check a rollouts file (or a run directory's latest); the file's dict."""
    p = find_rollouts(path)
    saved = _load(p)
    check_rollouts(saved, str(p))
    return saved


def _shape(x: Any) -> Optional[tuple]:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def check_rollouts(saved: Any, where: str = "rollouts") -> None:
    """The keys and shapes of a rollouts dict; a one-line ``ValueError`` naming the field."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: expected a dict as written by the trainer's save_rollouts, got {type(saved).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in saved]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; expected a file written by the trainer's save_rollouts")
    sig = saved["signals"]
    if not isinstance(sig, dict):
        raise ValueError(f"{where}: signals: expected a dict of tensors, got {type(sig).__name__}")
    for k in ("response_mask", "rewards", "group_ids"):
        if k not in sig:
            raise ValueError(f"{where}: signals has no {k!r}")
    mask = sig["response_mask"]
    if _shape(mask) is None or mask.dim() != 2:
        raise ValueError(f"{where}: signals.response_mask: expected a tensor [B, T], got {_shape(mask) or type(mask).__name__}")
    B, T = mask.shape
    for k, v in sig.items():
        if v is not None and (_shape(v) is None or v.dim() == 0 or v.shape[0] != B):
            raise ValueError(f"{where}: signals.{k}: expected a tensor with {B} rows (response_mask's), got "
                             f"{_shape(v) or type(v).__name__}")
    for k in ("advantages", "token_weights"):
        v = saved.get(k)
        if v is not None and _shape(v) != (B, T):
            raise ValueError(f"{where}: {k}: expected shape {(B, T)} (response_mask's), got {_shape(v) or type(v).__name__}")
    ids = saved.get("response_ids")
    if ids is not None and (_shape(ids) is None or ids.dim() != 2 or ids.shape[0] != B):
        raise ValueError(f"{where}: response_ids: expected a tensor [{B}, T'], got {_shape(ids) or type(ids).__name__}")
    lengths = [int(x) for x in mask.bool().sum(1)]
    tokens = saved["tokens"]
    if len(tokens) != len(lengths):
        raise ValueError(f"{where}: tokens has {len(tokens)} rows, response_mask {len(lengths)}")
    for i, (row, n) in enumerate(zip(tokens, lengths)):
        if len(row) != n:
            raise ValueError(f"{where}: tokens[{i}] has {len(row)} entries, response_mask row {i} has {n} valid positions")
    for k in ("texts", "questions"):
        v = saved.get(k)
        if v and len(v) != B:
            raise ValueError(f"{where}: {k}: expected {B} entries (one a response), got {len(v)}")


def _signals_of(saved: Dict[str, Any]) -> Dict[str, Any]:
    """The saved signals; ``token_ids`` from the saved ``response_ids`` and ``planning_mask``
    from the saved decoded ``tokens`` when the step did not store them (both are in every
    rollouts file)."""
    sig = {k: v for k, v in saved["signals"].items() if v is not None}
    if "token_ids" not in sig and saved.get("response_ids") is not None:
        sig["token_ids"] = torch.as_tensor(saved["response_ids"])
    if "planning_mask" not in sig:  # HICRA / SEPA: strategic grams in the decoded tokens
        from ..credit.planning import planning_mask_of

        mask = torch.as_tensor(sig["response_mask"]).bool()
        pm = torch.zeros(mask.shape, dtype=torch.long)
        for b, row in enumerate(saved["tokens"]):
            pos = mask[b].nonzero().squeeze(1)
            pm[b, pos] = torch.tensor(planning_mask_of([str(t) for t in row]), dtype=torch.long)
        sig["planning_mask"] = pm
    return sig


def saved_batch(saved: Dict[str, Any]) -> CreditBatch:
    """The saved :class:`CreditBatch` (validated again)."""
    return CreditBatch(**_signals_of(saved))


def available_signals(saved: Dict[str, Any]) -> List[str]:
    sig = _signals_of(saved)
    return [k for k in SIGNALS if k in sig]


# ---------------------------------------------------------------------------------------
# replay


def default_specs(saved: Optional[Dict[str, Any]] = None) -> List[str]:
    """The run's own spec (if ``saved`` names one), every registered method (a calibrator as
    its paper's pairing) and :data:`COMPOSITIONS`, canonical and without duplicates."""
    from ..credit.registry import list_methods
    from ..credit.spec import parse_spec

    cands: List[str] = []
    if saved is not None and isinstance(saved.get("credit"), str):
        cands.append(saved["credit"])
    cands += list_methods("estimator") + list_methods("calibrator") + list(COMPOSITIONS)
    out: List[str] = []
    for c in cands:
        try:
            canon = "+".join(m.name for m in parse_spec(c))
        except (KeyError, ValueError):
            continue  # a composition whose method is not registered here
        if canon not in out:
            out.append(canon)
    return out


def parse_methods(value: Any, field_name: str = "--methods") -> List[str]:
    """``"grpo,taco,oppo+stare"`` -> canonical specs; unknown or malformed -> ValueError naming the field."""
    from ..credit.spec import parse_spec

    items = value.split(",") if isinstance(value, str) else list(value or [])
    items = [str(s).strip() for s in items]
    if not items or any(not s for s in items):
        raise ValueError(f"{field_name}: expected a comma-separated list of credit specs (e.g. grpo,taco), got {value!r}")
    out = []
    for s in items:
        try:
            canon = "+".join(m.name for m in parse_spec(s))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{field_name}: bad credit spec {s!r}: {e.args[0] if e.args else e}") from None
        if canon not in out:
            out.append(canon)
    return out


def _credit_configs(credit_args: Sequence[str], spec_methods: Sequence[str], saved_configs=None) -> Dict[str, Dict[str, Any]]:
    """The run's saved config of each method (if any), overridden key by key by ``credit_args``."""
    from .config import parse_credit_args

    parsed = parse_credit_args(credit_args)
    out: Dict[str, Dict[str, Any]] = {}
    for name in spec_methods:
        merged = {**dict((saved_configs or {}).get(name) or {}), **parsed.get(name, {})}
        if merged:
            out[name] = merged
    return out


def _float_or_none(x):
    return None if x is None else torch.as_tensor(x).float()


def replay(saved: Dict[str, Any], specs: Optional[Sequence[str]] = None, *, credit_args: Sequence[str] = (), include_saved: bool = True) -> Inspection:
    """Credit of every spec in ``specs`` (default :func:`default_specs`) on the saved batch.

    A spec whose ``CreditPipeline.required_signals`` the batch lacks, or whose method raises,
    becomes a :class:`Skipped` entry instead. With ``include_saved`` the run's own advantages
    come first, labelled ``"<spec> (as trained)"``.
    """
    from ..credit.diagnostics import credit_diagnostics
    from ..credit.spec import CreditPipeline, parse_spec

    check_rollouts(saved)
    batch = saved_batch(saved)
    avail = set(available_signals(saved))
    specs = default_specs(saved) if specs is None else list(specs)
    views: List[MethodView] = []
    skipped: List[Skipped] = []
    if include_saved and saved.get("advantages") is not None:
        out = CreditOutput(advantages=saved["advantages"].float(), token_weights=_float_or_none(saved.get("token_weights")))
        name = str(saved.get("credit") or "run")
        views.append(MethodView(f"{name} (as trained)", name, "saved", out.advantages, out.token_weights, credit_diagnostics(batch, out)))
    # reference rows carried by the batch (the Monte Carlo true credit of a fidelity estimates
    # file, see fidelity.rollouts_with_true_credit): label -> [B, T] credit
    for label, c in (saved.get("reference_rows") or {}).items():
        c = torch.as_tensor(c).float()
        views.append(MethodView(label, "reference", "estimated", c, None, credit_diagnostics(batch, CreditOutput(advantages=c))))
    for spec in specs:
        try:
            pipe = CreditPipeline(spec, _credit_configs(credit_args, [m.name for m in parse_spec(spec)], saved.get("credit_configs")))
            for name, st in (saved.get("credit_state") or {}).items():
                if name in pipe.states:
                    pipe.states[name].load_state_dict(st)
        except (KeyError, ValueError, TypeError) as e:
            skipped.append(Skipped(spec, error=str(e.args[0] if e.args else e)))
            continue
        missing = sorted(pipe.required_signals - avail)
        if missing:
            skipped.append(Skipped(pipe.name, missing=missing))
            continue
        try:
            out = pipe(batch, update_state=False)
            diag = credit_diagnostics(batch, out)
        except Exception as e:  # noqa: BLE001 - one method failing must not lose the page
            skipped.append(Skipped(pipe.name, error=f"{type(e).__name__}: {e}"))
            continue
        views.append(MethodView(pipe.name, pipe.name, "replayed", out.advantages.detach().float(),
                                None if out.token_weights is None else out.token_weights.detach().float(), diag))
    return Inspection(views=views, skipped=skipped, available=sorted(avail))
