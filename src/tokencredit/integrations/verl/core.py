"""The verl plugin's core: registers the ``tc_*`` advantage estimators and the ``tokencredit``
policy loss in verl's registries (:func:`register`, called on ``import verl`` by
:mod:`tokencredit.integrations.verl`), and re-exports, under the names the trainer mode, the engine
and users import from here, the three modules that do the work:

* :mod:`.settings`: the plugin's names, the verl version check, the ``tokencredit`` settings
  (config section, ``TOKENCREDIT_VERL_CONFIG``, defaults) and one credit pipeline per settings;
* :mod:`.estimators` (driver): ``tc_<name>`` for every tokencredit estimator, with the per-token
  signals the trainer mode hands over around verl's advantage step (:func:`driver_signals`);
* :mod:`.losses` (workers): the policy loss ``tokencredit`` (the spec's calibrators, then verl's
  ``base_loss_mode``) and the engine losses for the actor and a tokencredit critic.

None of them imports the trainer mode or the engine, which build on them.
"""

from __future__ import annotations

from typing import Any

from . import estimators as _estimators
from . import losses as _losses
from . import settings as _settings
from .estimators import (
    STD_NORMALIZE_FIELD,
    driver_signals,
    estimator_names,
    estimator_settings,
    make_estimator,
    pop_estimator_metrics,
)
from .losses import (
    CRITIC_WEIGHTS_FIELD,
    calibrate,
    loss_context,
    loss_signals,
    tokencredit_policy_loss,
    tokencredit_ppo_loss,
    tokencredit_value_loss,
)
from .settings import (
    DRIVER_SIGNALS,
    ENGINE_MODEL_TYPE,
    ENV_VAR,
    ESTIMATOR_PREFIX,
    LOSS_MODE,
    LOSS_SIGNAL_HINTS,
    TESTED_VERL_VERSION,
    TRAINER_MODE,
    UNSUPPORTED_SIGNALS,
    WORKER_SIGNAL_KEYS,
    VerlCreditSettings,
    cached_pipeline,
    check_supported,
    check_verl_version,
    critic_spec,
    current_settings,
    install_settings,
    settings_from_config,
    settings_from_dict,
)

__all__ = ["register", *_settings.__all__, *_estimators.__all__, *_losses.__all__]

#: the per-call contexts, read here under their old names (``core._DRIVER``: the signals the
#: trainer mode opened around the advantage step; ``core._LOSS_CONTEXT``: what the engine loss
#: hands the policy loss), live: they are reassigned in their modules on every call
_LIVE = {"_DRIVER": _estimators, "_LOSS_CONTEXT": _losses}


def __getattr__(name: str) -> Any:
    if name in _LIVE:
        return getattr(_LIVE[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            register_adv_est(verl_name)(make_estimator(name))
    if LOSS_MODE not in POLICY_LOSS_REGISTRY:
        register_policy_loss(LOSS_MODE)(tokencredit_policy_loss)
