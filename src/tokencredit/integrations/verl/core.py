"""The verl plugin's core: settings, the ``tc_*`` advantage estimators and the policy and value
losses. Registered on ``import verl`` (see :mod:`tokencredit.integrations.verl`); imports nothing
of the trainer mode, which builds on it (:mod:`tokencredit.integrations.verl.trainer`).

* **advantage estimators** ``tc_<name>`` for every tokencredit estimator. verl calls a custom
  estimator with ``token_level_rewards``, ``response_mask``, ``config`` (the ``algorithm``
  section) and ``index`` (the prompt uid) only. An estimator that declares more signals
  (``entropy``, ``logprobs``, ``oracle_logprobs``, ``values``: GTPO, OPPO, OPD, GAE, PACT) reads
  them from :func:`driver_signals`, which the trainer mode opens around verl's advantage step with
  the step batch's signals; without it the estimator raises, naming the trainer mode.
* **policy loss** ``tokencredit``: the spec's calibrators on the micro-batch's advantages, then a
  verl policy loss (``base_loss_mode``, by default ``vanilla``) on the calibrated advantages.
* :func:`tokencredit_ppo_loss` / :func:`tokencredit_value_loss`: verl engine losses (the
  ``loss_fn`` of ``set_loss_fn``) for the actor (entropy, reference log-probs, the worker
  signals of tokencredit's actor engine (``mode_prob``, ``hidden_residual``, :mod:`.engine`) and
  the driver-stepped state of stateful methods reach the policy loss) and for a tokencredit critic
  (the loss the estimator's declared critic is trained with).

Hyperparameters (``tokencredit`` settings: ``spec``, ``base_loss_mode`` and one dict per method)
come from, in this order: the settings the trainer mode installed from the top-level config
section ``tokencredit`` (hydra: ``+tokencredit.spec=grpo+taco +tokencredit.taco.lam=0.5``),
else the environment variable ``TOKENCREDIT_VERL_CONFIG`` (JSON, same keys), else defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import numpy as np
import torch

import verl  # on `import verl` this module is loaded while verl/__init__ runs: __version__ is already set

from ...batch import CreditBatch, CreditInputError
from ...ops import masked_fill_zero
from ...plan import PlanError, plan_signals
from ...registry import CriticSpec, get_method, list_methods
from ...spec import CreditPipeline, parse_spec

__all__ = [
    "TESTED_VERL_VERSION",
    "ENV_VAR",
    "LOSS_MODE",
    "TRAINER_MODE",
    "ESTIMATOR_PREFIX",
    "DRIVER_SIGNALS",
    "ENGINE_MODEL_TYPE",
    "WORKER_SIGNAL_KEYS",
    "VerlCreditSettings",
    "estimator_names",
    "settings_from_dict",
    "settings_from_config",
    "install_settings",
    "current_settings",
    "check_supported",
    "critic_spec",
    "driver_signals",
    "pop_estimator_metrics",
    "calibrate",
    "tokencredit_policy_loss",
    "tokencredit_ppo_loss",
    "tokencredit_value_loss",
    "register",
]

log = logging.getLogger(__name__)

#: the verl minor version whose internals this module was written against
TESTED_VERL_VERSION = "0.9"
#: JSON settings for processes that the trainer mode does not reach (plain verl trainers)
ENV_VAR = "TOKENCREDIT_VERL_CONFIG"
LOSS_MODE = "tokencredit"
TRAINER_MODE = "tokencredit_sync"
ESTIMATOR_PREFIX = "tc_"

# Signals no verl code path delivers to a credit method, with the reason (none at present).
UNSUPPORTED_SIGNALS: Dict[str, str] = {}
#: the value of ``actor_rollout_ref.model.model_type`` that selects tokencredit's actor engine
#: (:mod:`.engine`), which returns the worker signals below from the actor's forward
ENGINE_MODEL_TYPE = "tokencredit_language_model"
#: signals the actor's forward returns to the policy loss (:mod:`.engine`), and the non-tensor
#: micro-batch key by which the trainer mode requests each for the actor update
WORKER_SIGNAL_KEYS = {"mode_prob": "tokencredit_mode_prob", "hidden_residual": "tokencredit_hidden_residual"}
#: signals the trainer mode hands to a driver-side estimator, and the verl pass each comes from
DRIVER_SIGNALS = {
    "entropy": "the old-log-prob pass (actor, before the update; verl computes it with calculate_entropy=True)",
    "logprobs": "the old-log-prob pass (old_log_probs)",
    "oracle_logprobs": "the oracle pass (the actor's compute_log_prob on the oracle-prompted input)",
    "values": "verl's critic (critic.enable=True), through the estimator's declared transform",
}
# Signals the policy loss can get, and how to get them (for the error message).
LOSS_SIGNAL_HINTS = {
    "logprobs": "always passed by verl",
    "old_logprobs": "always passed by verl",
    "entropy": f"set trainer.v1.trainer_mode={TRAINER_MODE} and actor_rollout_ref.actor.calculate_entropy=True",
    "ref_logprobs": f"set trainer.v1.trainer_mode={TRAINER_MODE} and use a reference policy "
    "(actor_rollout_ref.actor.use_kl_loss=True; kl_loss_coef may be 0)",
    "mode_prob": f"set trainer.v1.trainer_mode={TRAINER_MODE} and +actor_rollout_ref.model.model_type={ENGINE_MODEL_TYPE} "
    "(tokencredit's actor engine returns the top-1 probability of the update forward)",
    "hidden_residual": f"set trainer.v1.trainer_mode={TRAINER_MODE}, +actor_rollout_ref.model.model_type={ENGINE_MODEL_TYPE} "
    "and a LoRA actor (actor_rollout_ref.model.lora_rank > 0; the engine runs an adapter-off forward)",
}


def check_verl_version(version: Optional[str] = None) -> None:
    """Raise if the installed verl is not the minor version this module reaches into."""
    v = verl.__version__ if version is None else version
    if not str(v).startswith(TESTED_VERL_VERSION + "."):
        raise RuntimeError(
            f"tokencredit.integrations.verl was written against verl {TESTED_VERL_VERSION}.x (its estimator, "
            f"policy-loss and trainer registries and the engine's ppo_loss); the installed verl is {v}. "
            f"Install 'verl>={TESTED_VERL_VERSION}.1,<0.10' (pip install 'tokencredit[verl]')."
        )


# -- settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlCreditSettings:
    """What the verl plugin computes: a credit spec, per-method configs and the base loss.

    spec: a tokencredit credit spec, e.g. ``"grpo+taco"``. Its estimator must be the one named
        by ``algorithm.adv_estimator`` (``tc_grpo`` <-> ``grpo``); the policy loss applies only
        its calibrators. ``None``: estimators run alone with defaults, the loss refuses to run.
    base_loss_mode: the verl policy loss the calibrated advantages are handed to.
    configs: per-method overrides by method name, e.g. ``{"taco": {"lam": 0.5}}``.
    """

    spec: Optional[str] = None
    base_loss_mode: str = "vanilla"
    configs: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def key(self) -> str:
        """A stable text key (for caching one pipeline per distinct settings)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)


def _plain(x: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists (without importing omegaconf at module level)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, (DictConfig, ListConfig)):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with verl
        pass
    return x


def settings_from_dict(d: Any) -> VerlCreditSettings:
    """``{"spec": ..., "base_loss_mode": ..., "<method>": {...}}`` -> validated settings."""
    d = _plain(d)
    if d is None:
        return VerlCreditSettings()
    if not isinstance(d, Mapping):
        raise TypeError(f"tokencredit settings: expected a mapping, got {type(d).__name__} {d!r}")
    d = dict(d)
    spec = d.pop("spec", None)
    base = d.pop("base_loss_mode", "vanilla")
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"tokencredit.spec: expected a string like 'grpo+taco', got {spec!r}")
    if not isinstance(base, str) or base == LOSS_MODE:
        raise ValueError(
            f"tokencredit.base_loss_mode: expected the name of a verl policy loss other than "
            f"'{LOSS_MODE}' (e.g. 'vanilla'), got {base!r}"
        )
    configs = {}
    for name, cfg in d.items():
        if cfg is not None and not isinstance(cfg, Mapping):
            raise TypeError(f"tokencredit.{name}: expected a mapping of {name}'s config keys, got {cfg!r}")
        configs[str(name)] = dict(cfg or {})
    settings = VerlCreditSettings(spec=spec, base_loss_mode=base, configs=configs)
    if spec is not None:
        # build once so that a typo fails here, when the config is read, not in a worker mid-run
        check_supported(CreditPipeline(spec, {k: dict(v) for k, v in configs.items()}))
    return settings


def settings_from_config(config: Any) -> VerlCreditSettings:
    """Settings from the top-level ``tokencredit`` section of a verl (hydra) config."""
    section = config.get("tokencredit", None) if hasattr(config, "get") else None
    return settings_from_dict(section)


_INSTALLED: Optional[VerlCreditSettings] = None


def install_settings(settings: Optional[VerlCreditSettings]) -> None:
    """Make ``settings`` this process's settings (the trainer mode does this on the driver)."""
    global _INSTALLED
    if settings is not None and not isinstance(settings, VerlCreditSettings):
        raise TypeError(f"settings: expected VerlCreditSettings or None, got {type(settings).__name__}")
    _INSTALLED = settings


def _settings_from_env() -> Optional[VerlCreditSettings]:
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_VAR}: expected JSON like '{{\"spec\": \"grpo+surprisal\"}}', got {raw!r} ({e})") from None
    return settings_from_dict(d)


def current_settings() -> VerlCreditSettings:
    """Installed settings, else ``$TOKENCREDIT_VERL_CONFIG``, else defaults."""
    if _INSTALLED is not None:
        return _INSTALLED
    return _settings_from_env() or VerlCreditSettings()




# -- pipelines (one per process and distinct settings: this is where method state lives) ----

_PIPELINES: Dict[Tuple[str, str], CreditPipeline] = {}


def check_supported(pipeline: CreditPipeline) -> None:
    """Raise for a spec that verl cannot feed (see UNSUPPORTED_SIGNALS for the reasons)."""
    for m in pipeline.methods:
        for sig in sorted(m.requires):
            if sig in UNSUPPORTED_SIGNALS:
                raise ValueError(
                    f"credit spec '{pipeline.name}': method '{m.name}' needs '{sig}', which the verl integration "
                    f"cannot provide: {UNSUPPORTED_SIGNALS[sig]}"
                )
        if m.kind == "estimator":
            extra = sorted(set(m.requires) - set(DRIVER_SIGNALS))
            if extra:
                raise ValueError(
                    f"credit spec '{pipeline.name}': estimator '{m.name}' needs {extra}; the trainer mode gives a "
                    f"verl estimator only {sorted(DRIVER_SIGNALS)}"
                )


def _pipeline(kind: str, spec: str, settings: VerlCreditSettings) -> CreditPipeline:
    key = (kind + ":" + spec, settings.key())
    pipe = _PIPELINES.get(key)
    if pipe is None:
        names = {m.name for m in parse_spec(spec)}
        pipe = CreditPipeline(spec, {k: dict(v) for k, v in settings.configs.items() if k in names})
        check_supported(pipe)
        _PIPELINES[key] = pipe
    return pipe


def critic_spec(settings: VerlCreditSettings) -> Optional[CriticSpec]:
    """The critic the spec's methods declare (None: no critic), from the plan of the spec."""
    if settings.spec is None:
        return None
    pipe = _pipeline("plan", settings.spec, settings)
    try:
        return plan_signals(pipe, lora=False).critic
    except PlanError:
        # a teacher-scored oracle (no teacher is given here): the critic does not depend on it
        return next((m.critic(pipe.configs[m.name]) for m in pipe.methods if m.critic is not None and "values" in m.requires), None)


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
        v = ctx.signals[s].to(response_mask.device).float()
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


def _estimator_settings(name: str, settings: VerlCreditSettings, config: Any) -> VerlCreditSettings:
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


def _make_estimator(name: str):
    def estimator(token_level_rewards, response_mask, config=None, index=None, **unused):
        """verl advantage estimator backed by tokencredit's ``{name}`` (returns (advantages, returns))."""
        settings = _estimator_settings(name, current_settings(), config)
        pipe = _pipeline("estimator", name, settings)
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
    need = set()
    for cal in pipeline.calibrators:
        need |= cal.requires
    missing = sorted(s for s in need if signals.get(s) is None)
    if missing:
        hints = "; ".join(f"{s}: {LOSS_SIGNAL_HINTS.get(s, UNSUPPORTED_SIGNALS.get(s, 'not available'))}" for s in missing)
        raise CreditInputError(
            f"credit spec '{pipeline.name}' needs {missing} in verl's policy loss, which did not get them ({hints})"
        )
    mask = response_mask.bool()
    B = mask.shape[0]
    # calibrators read no outcome; rewards and groups only complete the batch contract
    batch = CreditBatch(
        response_mask=mask,
        rewards=torch.zeros(B, dtype=torch.float32, device=mask.device),
        group_ids=torch.arange(B, device=mask.device),
        **{k: v.detach().float() for k, v in signals.items() if v is not None and k in need},
    )
    adv = advantages.detach().float()
    metrics: Dict[str, float] = {}
    for cal in pipeline.calibrators:
        res = cal.fn(batch, adv, pipeline.configs[cal.name], pipeline.states.get(cal.name))
        adv = res.advantages
        metrics.update(res.metrics)
    adv = masked_fill_zero(adv, mask)
    if not torch.isfinite(adv).all():
        raise FloatingPointError(f"credit spec '{pipeline.name}' produced non-finite advantages")
    return adv.to(advantages.dtype), metrics



@dataclass
class _LossContext:
    settings: VerlCreditSettings
    signals: Dict[str, torch.Tensor]
    credit_state: Optional[Dict[str, Any]] = None


_LOSS_CONTEXT: Optional[_LossContext] = None


@contextlib.contextmanager
def _loss_context(
    settings: VerlCreditSettings, signals: Dict[str, torch.Tensor], credit_state: Optional[Dict[str, Any]] = None
) -> Iterator[None]:
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
    pipe = _pipeline("loss", settings.spec, settings)
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

    with _loss_context(settings, loss_signals(model_output, data), credit_state):
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


# -- registration --------------------------------------------------------------------------


def register() -> None:
    """Register the ``tc_*`` estimators and the ``tokencredit`` policy loss in verl's registries."""
    check_verl_version()
    from verl.trainer.ppo.core_algos import (
        ADV_ESTIMATOR_REGISTRY,
        POLICY_LOSS_REGISTRY,
        register_adv_est,
        register_policy_loss,
    )

    for verl_name, name in estimator_names().items():
        if verl_name not in ADV_ESTIMATOR_REGISTRY:  # verl refuses a second, different function
            register_adv_est(verl_name)(_make_estimator(name))
    if LOSS_MODE not in POLICY_LOSS_REGISTRY:
        register_policy_loss(LOSS_MODE)(tokencredit_policy_loss)
