"""Test-only verl module (``VERL_USE_EXTERNAL_MODULES=...,tc_capture``): records what verl's
advantage step and policy loss received, in every process, to ``$TC_CAPTURE_DIR``.

* driver: every advantage-estimator call (``core_algos.get_adv_estimator_fn``): its inputs
  (``token_level_rewards``, ``response_mask``, ``index``), the signals tokencredit's trainer mode
  opened around it (``core._DRIVER``) and its output advantages;
* actor workers: every policy-loss call (``core_algos.get_policy_loss_fn``): the advantages the
  loss got from the driver, the log-probs, the signals tokencredit's engine loss handed over
  (``core._LOSS_CONTEXT``: entropy, mode_prob, hidden_residual, reference log-probs), the credit
  state shipped with the loss, and the advantages (and rollout-correction IS weights, where verl's
  ``algorithm.rollout_correction`` made them) verl's base policy loss finally received.

Files are safetensors (tensors) with JSON metadata; nothing is pickled. Only what verl passes
through its own registries is read: no tokencredit code is changed by this module.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
from safetensors.torch import save_file

_DIR = os.environ.get("TC_CAPTURE_DIR")
_COUNTER = itertools.count()
_OPEN = []  # the record of the outer (tokencredit) policy-loss call, while it runs


def _save(kind: str, tensors: dict, meta: dict) -> None:
    if not _DIR:
        return
    os.makedirs(_DIR, exist_ok=True)
    path = os.path.join(_DIR, f"{kind}-{os.getpid()}-{next(_COUNTER):04d}.safetensors")
    clean = {k: v.detach().float().cpu().clone().contiguous() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    save_file(clean, path, metadata={"meta": json.dumps(meta)})


def _tc_core():
    return sys.modules.get("tokencredit.integrations.verl.core")


def _wrap_estimator(name, fn):
    def estimator(*args, **kwargs):
        adv, ret = fn(*args, **kwargs)
        core = _tc_core()
        ctx = getattr(core, "_DRIVER", None) if core is not None else None
        tensors = {"token_level_rewards": kwargs["token_level_rewards"], "response_mask": kwargs["response_mask"],
                   "advantages": adv, "returns": ret}
        if ctx is not None:
            tensors.update({f"signal.{k}": v for k, v in ctx.signals.items()})
        index = kwargs.get("index")
        uids = [str(u) for u in index] if index is not None else None
        _save("estimator", tensors, {"name": name, "uids": uids})
        return adv, ret

    return estimator


def _wrap_policy_loss(name, fn):
    def policy_loss(*args, **kwargs):
        core = _tc_core()
        is_tc = core is not None and name == getattr(core, "LOSS_MODE", None)
        if is_tc:
            ctx = core._LOSS_CONTEXT
            rec = {"advantages_in": kwargs["advantages"], "old_log_prob": kwargs["old_log_prob"],
                   "log_prob": kwargs["log_prob"], "response_mask": kwargs["response_mask"]}
            if kwargs.get("rollout_is_weights") is not None:  # verl's rollout correction (rollout_corr_helper)
                rec["rollout_is_weights_in"] = kwargs["rollout_is_weights"]
            meta = {"loss_mode": name, "credit_state": None}
            if ctx is not None:
                rec.update({f"signal.{k}": v for k, v in ctx.signals.items()})
                meta["credit_state"] = ctx.credit_state
            _OPEN.append((rec, meta))
            try:
                return fn(*args, **kwargs)
            finally:
                rec, meta = _OPEN.pop()
                _save("loss", rec, meta)
        if _OPEN:  # the base loss inside tokencredit's: the advantages it finally received
            _OPEN[-1][0]["advantages_out"] = kwargs["advantages"]
            if kwargs.get("rollout_is_weights") is not None:
                _OPEN[-1][0]["rollout_is_weights_out"] = kwargs["rollout_is_weights"]
            _OPEN[-1][1]["base_loss_mode"] = name
            return fn(*args, **kwargs)
        _save("loss", {"advantages_in": kwargs["advantages"], "advantages_out": kwargs["advantages"],
                       "old_log_prob": kwargs["old_log_prob"], "log_prob": kwargs["log_prob"],
                       "response_mask": kwargs["response_mask"]}, {"loss_mode": name, "credit_state": None})
        return fn(*args, **kwargs)

    return policy_loss


def install() -> None:
    from verl.trainer.ppo import core_algos

    if getattr(core_algos.get_adv_estimator_fn, "_tc_capture", False):
        return
    get_est, get_loss = core_algos.get_adv_estimator_fn, core_algos.get_policy_loss_fn

    def get_adv_estimator_fn(name):
        return _wrap_estimator(str(name), get_est(name))

    def get_policy_loss_fn(name):
        return _wrap_policy_loss(str(name), get_loss(name))

    get_adv_estimator_fn._tc_capture = get_policy_loss_fn._tc_capture = True
    core_algos.get_adv_estimator_fn = get_adv_estimator_fn
    core_algos.get_policy_loss_fn = get_policy_loss_fn
    # verl's engine loss imported the name at its own import
    import verl.workers.utils.losses as losses

    losses.get_policy_loss_fn = get_policy_loss_fn


install()
