"""The verl plugin's settings and credit pipelines, shared by the driver's estimators
(:mod:`.estimators`), the workers' losses (:mod:`.losses`) and the trainer mode.

* the names the plugin registers and the verl version it reaches into;
* :class:`VerlCreditSettings` (``spec``, ``base_loss_mode`` and one dict per method), from, in
  this order: the settings the trainer mode installed from the top-level config section
  ``tokencredit`` (hydra: ``+tokencredit.spec=grpo+taco +tokencredit.taco.lam=0.5``), else the
  environment variable ``TOKENCREDIT_VERL_CONFIG`` (JSON, same keys), else defaults;
* one :class:`~tokencredit.credit.spec.CreditPipeline` per process and distinct settings (where method
  state lives), and the check that verl can feed a spec's signals.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import verl  # on `import verl` this module is loaded while verl/__init__ runs: __version__ is already set

from ...credit.plan import PlanError, plan_signals
from ...credit.registry import CriticSpec
from ...credit.spec import CreditPipeline, parse_spec

__all__ = [
    "TESTED_VERL_VERSION",
    "ENV_VAR",
    "LOSS_MODE",
    "TRAINER_MODE",
    "ESTIMATOR_PREFIX",
    "UNSUPPORTED_SIGNALS",
    "ENGINE_MODEL_TYPE",
    "WORKER_SIGNAL_KEYS",
    "DRIVER_SIGNALS",
    "LOSS_SIGNAL_HINTS",
    "check_verl_version",
    "VerlCreditSettings",
    "settings_from_dict",
    "settings_from_config",
    "install_settings",
    "current_settings",
    "check_supported",
    "critic_spec",
    "cached_pipeline",
]

#: the verl minor version whose internals this module was written against
TESTED_VERL_VERSION = "0.9"
#: JSON settings for processes that the trainer mode does not reach (plain verl trainers)
ENV_VAR = "TOKENCREDIT_VERL_CONFIG"
LOSS_MODE = "tokencredit"
TRAINER_MODE = "tokencredit_sync"
ESTIMATOR_PREFIX = "tc_"

# Signals no verl code path delivers to a credit method, with the reason.
UNSUPPORTED_SIGNALS: Dict[str, str] = {
    "planning_mask": "the strategic-gram planning tokens of the decoded response (HICRA, SEPA) are not shipped to "
    "verl's workers; expected a spec without hicra/sepa here (the own trainer and TokenCreditGRPOTrainer compute them)",
    "outcome_saliency": "OAR-G's input-gradient pass (a backward of the policy to its input embeddings each step) "
    "runs in no verl worker; expected a spec without oar here (the own trainer computes it)",
}
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
    "token_ids": "the rollout's own tokens (the step batch's responses; no pass)",
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


def cached_pipeline(kind: str, spec: str, settings: VerlCreditSettings) -> CreditPipeline:
    """This process's one :class:`CreditPipeline` of ``spec`` for a use (``kind``) and settings, checked for verl."""
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
    pipe = cached_pipeline("plan", settings.spec, settings)
    try:
        return plan_signals(pipe, lora=False).critic
    except PlanError:
        # a teacher-scored oracle (no teacher is given here): the critic does not depend on it
        return next((m.critic(pipe.configs[m.name]) for m in pipe.methods if m.critic is not None and "values" in m.requires), None)
