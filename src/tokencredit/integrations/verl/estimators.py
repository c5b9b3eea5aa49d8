"""The verl plugin's advantage estimators ``tc_<name>``, one per tokencredit estimator (driver side).

verl calls a custom estimator with ``token_level_rewards``, ``response_mask``, ``config`` (the
``algorithm`` section) and ``index`` (the prompt uid) only. An estimator that declares more
signals (``entropy``, ``logprobs``, ``oracle_logprobs``, ``values``, ``token_ids``: GTPO, OPPO,
OPD, GAE, PACT, KTAE) reads them from :func:`driver_signals`, which the trainer mode opens around verl's advantage step
with the step batch's signals; without it the estimator raises, naming the trainer mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional

import numpy as np
import torch

from ...credit.batch import CreditBatch, CreditInputError
from ...credit.registry import get_method, list_methods
from ...credit.spec import parse_spec
from .settings import (
    DRIVER_SIGNALS,
    ESTIMATOR_PREFIX,
    TRAINER_MODE,
    VerlCreditSettings,
    cached_pipeline,
    current_settings,
)

__all__ = ["driver_signals", "estimator_names", "estimator_settings", "make_estimator", "pop_estimator_metrics", "STD_NORMALIZE_FIELD"]


# -- driver-side signals for estimators ----------------------------------------------------


@dataclass
class _DriverSignals:
    response_mask: torch.Tensor  # [B, T], the rows and padding of the step batch, as verl pads them
    signals: Dict[str, torch.Tensor]


_DRIVER: Optional[_DriverSignals] = None


@contextlib.contextmanager
def driver_signals(response_mask: torch.Tensor, signals: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Make ``signals`` ([B, T] tensors by CreditBatch name, laid out like ``response_mask``) the
    per-token signals of the estimator call(s) inside the block. The trainer mode opens this
    around verl's ``_compute_advantage``; the estimator checks that verl's ``response_mask`` is
    the one given here (same rows, same order, same padding) before it reads a signal."""
    global _DRIVER
    bad = [k for k in signals if k not in DRIVER_SIGNALS]
    if bad:
        raise ValueError(f"driver_signals: expected signals among {sorted(DRIVER_SIGNALS)}, got {sorted(bad)}")
    for k, v in signals.items():
        if tuple(v.shape) != tuple(response_mask.shape):
            raise CreditInputError(f"{k}: expected shape {tuple(response_mask.shape)} (as response_mask), got {tuple(v.shape)}")
    prev, _DRIVER = _DRIVER, _DriverSignals(response_mask.detach(), {k: v.detach() for k, v in signals.items()})
    try:
        yield
    finally:
        _DRIVER = prev


def _estimator_signals(name: str, need, response_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    ctx = _DRIVER
    if ctx is None:
        raise CreditInputError(
            f"estimator '{name}' needs {sorted(need)}, which verl's advantage step does not pass: set "
            f"trainer.v1.trainer_mode={TRAINER_MODE} (it computes them on the driver: "
            + "; ".join(f"{s}: {DRIVER_SIGNALS[s]}" for s in sorted(need)) + ")"
        )
    if tuple(ctx.response_mask.shape) != tuple(response_mask.shape) or not torch.equal(
        ctx.response_mask.bool().cpu(), response_mask.bool().cpu()
    ):
        raise CreditInputError(
            f"response_mask: the driver's signals were laid out for a mask of shape {tuple(ctx.response_mask.shape)}, "
            f"verl's estimator got another of shape {tuple(response_mask.shape)} (rows reordered or re-padded)"
        )
    missing = sorted(s for s in need if s not in ctx.signals)
    if missing:
        raise CreditInputError(f"estimator '{name}' needs {missing}; the trainer mode gave only {sorted(ctx.signals)}")
    out = {}
    for s in need:
        v = ctx.signals[s].to(response_mask.device)
        v = v.float() if v.is_floating_point() else v  # token ids stay integers
        if s == "values":
            # verl's values[:, t] is V at the state before response token t (the output at the position
            # that predicts token t) = CreditBatch values[:, t]; the value after the last token is never read
            v = torch.cat([v, v.new_zeros(v.shape[0], 1)], dim=1)
        out[s] = v
    return out


# -- advantage estimators ------------------------------------------------------------------


def estimator_names() -> Dict[str, str]:
    """verl estimator name -> tokencredit estimator, for every registered estimator."""
    return {ESTIMATOR_PREFIX + n: n for n in list_methods("estimator")}


def _group_ids(index: Any, batch_size: int) -> torch.Tensor:
    if index is None:
        raise CreditInputError(
            "index: tokencredit's estimators need the prompt uid of every response (verl passes "
            "non_tensor_batch['uid'] as index); got None"
        )
    idx = np.asarray(index)
    if idx.shape != (batch_size,):
        raise CreditInputError(f"index: expected one uid per response, shape ({batch_size},), got {idx.shape}")
    # uids are strings (uuid4 per prompt); only equality matters, so map them to integer ids
    _, inverse = np.unique(idx.astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


#: the estimator config field that verl's ``algorithm.norm_adv_by_std_in_grpo`` sets: a method
#: declares the group-std switch by having this field (GRPO); others ignore verl's setting
STD_NORMALIZE_FIELD = "std_normalize"


def estimator_settings(name: str, settings: VerlCreditSettings, config: Any) -> VerlCreditSettings:
    """The settings for estimator ``name``, with verl's ``norm_adv_by_std_in_grpo`` honoured by an
    estimator whose config has the group-std switch (:data:`STD_NORMALIZE_FIELD`)."""
    if settings.spec is not None:
        spec_est = parse_spec(settings.spec)[0].name
        if spec_est != name:
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' starts with estimator '{spec_est}', but verl runs "
                f"algorithm.adv_estimator={ESTIMATOR_PREFIX}{name}; make them agree"
            )
    fields = {f.name for f in dataclasses.fields(get_method(name).config_cls)}
    if STD_NORMALIZE_FIELD not in fields or config is None or not hasattr(config, "get"):
        return settings
    norm = config.get("norm_adv_by_std_in_grpo", True)
    given = settings.configs.get(name, {})
    if STD_NORMALIZE_FIELD in given:
        if bool(given[STD_NORMALIZE_FIELD]) != bool(norm):
            raise ValueError(
                f"tokencredit.{name}.{STD_NORMALIZE_FIELD}={given[STD_NORMALIZE_FIELD]} contradicts "
                f"algorithm.norm_adv_by_std_in_grpo={norm}; set one of them"
            )
        return settings
    configs = dict(settings.configs)
    configs[name] = {**given, STD_NORMALIZE_FIELD: bool(norm)}
    return dataclasses.replace(settings, configs=configs)




#: the metrics of the estimator calls since the last :func:`pop_estimator_metrics` (driver process):
#: verl's estimator signature returns (advantages, returns) only, so the trainer mode collects the
#: pipeline's own metrics here and hands them to verl's logger under ``tokencredit/``
_ESTIMATOR_METRICS: Dict[str, float] = {}


def pop_estimator_metrics() -> Dict[str, float]:
    """The estimator metrics (``gtpo/...``, ``oppo/...``, ``pact/...``) of the calls since the last pop."""
    out = dict(_ESTIMATOR_METRICS)
    _ESTIMATOR_METRICS.clear()
    return out


def make_estimator(name: str):
    """verl's advantage estimator ``tc_<name>`` (verl's signature) running tokencredit's estimator ``name``."""
    def estimator(token_level_rewards, response_mask, config=None, index=None, **unused):
        """verl advantage estimator backed by tokencredit's ``{name}`` (returns (advantages, returns))."""
        settings = estimator_settings(name, current_settings(), config)
        pipe = cached_pipeline("estimator", name, settings)
        if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
            raise CreditInputError(
                f"token_level_rewards / response_mask: expected two [B, T] tensors of one shape, got "
                f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
            )
        B = token_level_rewards.shape[0]
        groups = _group_ids(index, B)
        mask = response_mask.bool()
        need = pipe.estimator.requires
        signals = _estimator_signals(name, need, response_mask) if need else {}
        # outcome reward = sum over tokens, as verl's own outcome estimators (it includes the
        # per-token KL penalty when algorithm.use_kl_in_reward is on)
        rewards = token_level_rewards.sum(dim=-1)
        # Rows without a valid token (verl's synthetic padding samples, which copy a real
        # sample's uid) would join that group's statistics with reward 0; leave them out.
        keep = mask.any(dim=1)
        adv = torch.zeros_like(token_level_rewards)
        ret = torch.zeros_like(token_level_rewards)
        if keep.any():
            k = keep.cpu()
            batch = CreditBatch(
                response_mask=mask[keep],
                rewards=rewards[keep].float(),
                group_ids=groups[k].to(mask.device),
                **{s: v[keep] for s, v in signals.items()},
            )
            out = pipe(batch)
            _ESTIMATOR_METRICS.update({k: float(v) for k, v in out.metrics.items()})
            adv[keep] = out.advantages.to(adv.dtype)
            # outcome estimators: returns = advantages, as in verl; a critic's estimator gives its targets
            ret[keep] = (out.returns if out.returns is not None else out.advantages).to(ret.dtype)
        return adv, ret

    estimator.__name__ = f"tokencredit_{name}_estimator"
    estimator.__qualname__ = estimator.__name__
    return estimator
