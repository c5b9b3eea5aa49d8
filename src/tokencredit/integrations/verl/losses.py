"""The verl plugin's losses (worker side): the policy loss ``tokencredit`` (the spec's calibrators
on the micro-batch's advantages, then a verl policy loss, ``base_loss_mode``, by default
``vanilla``), and the engine losses the trainer mode installs with ``set_loss_fn``:
:func:`tokencredit_ppo_loss` for the actor (entropy, reference log-probs, the worker signals of
tokencredit's actor engine, ``mode_prob`` and ``hidden_residual`` (:mod:`.engine`), and the
driver-stepped state of stateful methods reach the policy loss) and :func:`tokencredit_value_loss`
for a tokencredit critic (the loss the estimator's declared critic is trained with).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import torch

from ...credit.batch import CreditInputError
from ...credit.spec import CreditPipeline, credit_batch
from .settings import (
    ENV_VAR,
    LOSS_MODE,
    LOSS_SIGNAL_HINTS,
    TRAINER_MODE,
    UNSUPPORTED_SIGNALS,
    WORKER_SIGNAL_KEYS,
    VerlCreditSettings,
    cached_pipeline,
    critic_spec,
    current_settings,
)

__all__ = [
    "CRITIC_WEIGHTS_FIELD",
    "calibrate",
    "loss_context",
    "tokencredit_policy_loss",
    "loss_signals",
    "tokencredit_ppo_loss",
    "tokencredit_value_loss",
]


# -- calibration inside the policy loss ----------------------------------------------------


def calibrate(
    pipeline: CreditPipeline,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    signals: Mapping[str, Optional[torch.Tensor]],
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Apply the calibrators of ``pipeline`` to given ``advantages`` [B, T] (pure, no state step).

    The estimator already ran on the driver; here only the per-token reweighting happens, on the
    micro-batch the loss sees. ``signals`` holds detached [B, T] tensors by CreditBatch name.
    """
    need = pipeline.calibrator_signals
    missing = sorted(s for s in need if signals.get(s) is None)
    if missing:
        hints = "; ".join(f"{s}: {LOSS_SIGNAL_HINTS.get(s, UNSUPPORTED_SIGNALS.get(s, 'not available'))}" for s in missing)
        raise CreditInputError(
            f"credit spec '{pipeline.name}' needs {missing} in verl's policy loss, which did not get them ({hints})"
        )
    # the spec's own worker half (CreditPipeline.calibrate, the one the own trainer runs):
    # calibrators read no outcome, rewards and groups only complete the batch contract
    out = pipeline.calibrate(credit_batch(response_mask.bool(), signals, need=need), advantages.detach().float())
    return out.advantages.to(advantages.dtype), out.metrics



@dataclass
class _LossContext:
    settings: VerlCreditSettings
    signals: Dict[str, torch.Tensor]
    credit_state: Optional[Dict[str, Any]] = None


_LOSS_CONTEXT: Optional[_LossContext] = None


@contextlib.contextmanager
def loss_context(
    settings: VerlCreditSettings, signals: Dict[str, torch.Tensor], credit_state: Optional[Dict[str, Any]] = None
) -> Iterator[None]:
    """The settings, worker signals and credit state that :func:`tokencredit_policy_loss` reads, for the duration."""
    # verl's loss signature has no slot for extra signals; the wrapper hands them over for the
    # duration of one call (the engine computes micro-batch losses one after another)
    global _LOSS_CONTEXT
    prev, _LOSS_CONTEXT = _LOSS_CONTEXT, _LossContext(settings, signals, credit_state)
    try:
        yield
    finally:
        _LOSS_CONTEXT = prev


def tokencredit_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
):
    """verl policy loss ``tokencredit``: calibrate ``advantages``, then verl's ``base_loss_mode``."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    ctx = _LOSS_CONTEXT
    settings = ctx.settings if ctx is not None else current_settings()
    if settings.spec is None:
        raise ValueError(
            f"policy_loss.loss_mode={LOSS_MODE} needs a credit spec: set +tokencredit.spec=... with "
            f"trainer.v1.trainer_mode={TRAINER_MODE}, or ${ENV_VAR}='{{\"spec\": \"grpo+surprisal\"}}'"
        )
    pipe = cached_pipeline("loss", settings.spec, settings)
    if pipe.states:
        # a stateful method (STARE's controller) steps once per step on the driver, from the step's
        # pre-update batch; the trainer mode ships the stepped state with the loss function
        state = ctx.credit_state if ctx is not None else None
        if state is None:
            raise ValueError(
                f"credit spec '{pipe.name}' has state {sorted(pipe.states)}, stepped once per step on the driver: "
                f"set trainer.v1.trainer_mode={TRAINER_MODE} (the policy loss alone has no step boundary)"
            )
        pipe.load_state_dict(state)
    signals = {"logprobs": log_prob, "old_logprobs": old_log_prob}
    if ctx is not None:
        signals.update(ctx.signals)
    adv, credit_metrics = calibrate(pipe, response_mask, advantages, signals)
    base = get_policy_loss_fn(settings.base_loss_mode)
    loss, metrics = base(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=adv,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    metrics = dict(metrics)
    metrics.update({f"tokencredit/{k}": float(v) for k, v in credit_metrics.items()})
    return loss, metrics


def loss_signals(model_output: Mapping[str, Any], data: Any) -> Dict[str, torch.Tensor]:
    """Entropy, reference log-probs and the worker signals (``mode_prob``, ``hidden_residual``) of
    one engine micro-batch, as padded [B, T] tensors laid out like the ``log_prob`` verl's
    ``ppo_loss`` hands to the policy loss."""
    from verl.workers.utils.padding import no_padding_2_padding

    out: Dict[str, torch.Tensor] = {}
    # entropy from verl's engine; mode_prob / hidden_residual from tokencredit's (.engine), all laid
    # out like log_probs: the same un-padding ppo_loss applies to log_probs, so positions line up
    for key in ("entropy", *WORKER_SIGNAL_KEYS):
        value = model_output.get(key, None)
        if value is not None:
            out[key] = no_padding_2_padding(value, data).detach()
    if "ref_log_prob" in data.keys():
        out["ref_logprobs"] = data.select("ref_log_prob").to_padded_tensor()["ref_log_prob"].detach()
    return out


def tokencredit_ppo_loss(
    config, model_output, data, dp_group=None, *, settings: VerlCreditSettings, credit_state: Optional[Dict[str, Any]] = None
):
    """verl's engine loss ``verl.workers.utils.losses.ppo_loss`` with entropy, reference log-probs and
    the driver-stepped credit state handed to the ``tokencredit`` policy loss. The trainer mode
    installs it with ``set_loss_fn(partial(tokencredit_ppo_loss, config=actor_config, settings=...,
    credit_state=...))``, again every step when the spec has state."""
    from verl.workers.utils.losses import ppo_loss

    with loss_context(settings, loss_signals(model_output, data), credit_state):
        return ppo_loss(config, model_output, data, dp_group)


#: the TransferQueue field holding the critic's per-token sample weights (after-actor critics)
CRITIC_WEIGHTS_FIELD = "tc_critic_weights"


def tokencredit_value_loss(config, model_output, data, dp_group=None, *, settings: VerlCreditSettings):
    """verl engine loss for the critic worker: the loss of the critic the spec's estimator
    declares (``CriticSpec.loss``: PACT's BCE on the [0, 1] reward, GAE's squared error on the
    returns), on the value model's raw output, with the per-token weights the trainer mode wrote
    (``tc_critic_weights``: PACT's masked IS weights of the updated actor) when present.

    The outcome reward is ``rm_scores`` summed over tokens (verl's reward, before any KL penalty).
    Normalised over verl's global mini-batch like verl's own losses: the micro-batch's token mean
    times its share of the global tokens (``batch_num_tokens``) times ``dp_size``, so the
    accumulated gradient does not depend on the micro-batch split.
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.torch_functional import masked_mean
    from verl.workers.utils.padding import no_padding_2_padding

    spec = critic_spec(settings)
    if spec is None:
        raise ValueError(f"tokencredit_value_loss: credit spec '{settings.spec}' declares no critic")
    head_out = no_padding_2_padding(model_output["values"], data)  # [B, T], the head's raw output
    fields = ["response_mask", "returns", "rm_scores"]
    if CRITIC_WEIGHTS_FIELD in data.keys():
        fields.append(CRITIC_WEIGHTS_FIELD)
    if spec.after_actor and CRITIC_WEIGHTS_FIELD not in fields:
        raise ValueError(
            f"credit spec '{settings.spec}': its critic trains after the actor on per-token IS weights, but the critic's "
            f"batch has no field '{CRITIC_WEIGHTS_FIELD}' (it has {sorted(data.keys())}); the trainer mode "
            f"trainer.v1.trainer_mode={TRAINER_MODE} writes it after the actor update and must hand the critic the batch "
            f"metadata returned by that write"
        )
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].bool()
    rewards = padded["rm_scores"].float().sum(dim=-1)
    weights = padded[CRITIC_WEIGHTS_FIELD] if CRITIC_WEIGHTS_FIELD in fields else None
    loss = spec.loss(head_out, rewards=rewards, returns=padded["returns"], mask=mask, weights=weights)
    dp_size, n_global = data["dp_size"], data["batch_num_tokens"]
    global_norm = n_global is not None
    if global_norm:
        loss = loss * mask.sum().to(loss.dtype) / n_global * dp_size
    values = torch.sigmoid(head_out) if spec.transform == "sigmoid" else head_out
    agg = AggregationType.SUM if (global_norm or dp_size > 1) else AggregationType.MEAN
    metrics = {
        "critic/vf_loss": Metric(value=loss.detach(), aggregation=agg),
        "critic/vpred_mean": masked_mean(values.detach(), mask).item(),
    }
    if weights is not None:
        metrics["critic/is_weight_kept"] = masked_mean((weights > 0).float(), mask).item()
    return loss, metrics
