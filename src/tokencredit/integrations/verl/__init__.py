"""tokencredit in verl: a ``verl.plugins`` entry point, selected by verl's own config keys.

``pip install tokencredit[verl]`` installs an entry point in the group ``verl.plugins``; verl
imports it on ``import verl`` in every process (driver, TaskRunner, every Ray worker), so these
registrations exist wherever verl looks them up (checked against verl 0.9.1):

* :mod:`.core`: registers the advantage estimators ``tc_<name>`` (``algorithm.adv_estimator=tc_grpo``)
  and the policy loss ``tokencredit`` (``actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit``),
  and re-exports the modules that do the work: :mod:`.settings` (the settings channel and one
  credit pipeline per settings), :mod:`.estimators` (driver side) and :mod:`.losses` (the policy
  loss and the engine losses the trainer mode installs; worker side);
* :mod:`.engine`: tokencredit's FSDP actor engine (``+actor_rollout_ref.model.model_type=
  tokencredit_language_model``, registered in verl's ``EngineRegistry``), whose forward also
  returns ACPO's top-1 probability and ARCA's adapter-on/off hidden-state residual;
* :mod:`.oracle`: the oracle-prompted inputs of OPPO/OPD's oracle pass (driver side, pure);
* :mod:`.record`: the step batch in the format ``tokencredit inspect`` replays (driver side, pure);
* :mod:`.trainer`: the trainer mode ``tokencredit_sync`` (``trainer.v1.trainer_mode=tokencredit_sync``),
  verl's synchronous PPO trainer plus the passes the spec's methods declare (``tokencredit.credit.plan``).

Dependencies run one way: ``trainer -> oracle, record, core``, ``engine -> settings`` and
``core -> estimators, losses -> settings``; ``core`` and ``oracle`` import nothing of the trainer
mode or the engine, and this package module imports all of them.
"""

from __future__ import annotations

import logging

from . import core
from .core import (
    CRITIC_WEIGHTS_FIELD,
    DRIVER_SIGNALS,
    ENGINE_MODEL_TYPE,
    ENV_VAR,
    ESTIMATOR_PREFIX,
    LOSS_MODE,
    TESTED_VERL_VERSION,
    TRAINER_MODE,
    UNSUPPORTED_SIGNALS,
    WORKER_SIGNAL_KEYS,
    VerlCreditSettings,
    cached_pipeline,
    calibrate,
    check_supported,
    check_verl_version,
    critic_spec,
    current_settings,
    driver_signals,
    estimator_names,
    install_settings,
    loss_context,
    loss_signals,
    make_estimator,
    settings_from_config,
    settings_from_dict,
    tokencredit_policy_loss,
    tokencredit_ppo_loss,
    tokencredit_value_loss,
)

log = logging.getLogger(__name__)

try:
    core.register()
except Exception:
    # verl logs a failing plugin at debug level only; say it where it will be seen
    log.error("tokencredit's verl plugin failed to register; tc_* estimators and loss_mode=%s are unavailable", LOSS_MODE, exc_info=True)
    raise

# The actor engine (worker signals) must be registered in every process that builds an actor;
# a failure leaves the other methods working, and a run that selects the engine then fails in
# verl's EngineRegistry naming the model type.
try:
    from . import engine  # noqa: F401,E402
except Exception:
    log.warning("tokencredit: actor_rollout_ref.model.model_type=%s is unavailable (tokencredit's actor engine failed to "
                "register)", ENGINE_MODEL_TYPE, exc_info=True)

# The trainer mode imports verl's v1 trainer (about 3 s on a CPU, once per process). A failure
# there must not take the estimators and the loss down with it, but it must be visible.
try:
    from . import trainer  # noqa: F401,E402
except Exception:
    log.warning("tokencredit: trainer.v1.trainer_mode=%s is unavailable (import of verl's v1 trainer failed)", TRAINER_MODE, exc_info=True)
