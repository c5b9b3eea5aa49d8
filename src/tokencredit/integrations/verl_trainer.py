"""``trainer.v1.trainer_mode=tokencredit_sync``: verl's synchronous PPO trainer, plus credit.

Uses only verl 0.9's extension points: ``register_trainer`` (the v1 trainer registry),
``PPOTrainerSync`` (subclassed; only its ``__init__`` and the ``on_init_end`` hook are
extended) and the actor worker's ``set_loss_fn`` (a registered, one-to-all worker method verl
itself uses to install the critic's loss). What it adds:

1. On the driver, before any worker starts: reads the top-level ``tokencredit`` config section,
   checks it against the rest of the config (estimator name, loss mode, entropy, reference
   policy) and installs it as this process's settings, which the ``tc_*`` estimators read
   (verl computes advantages in the trainer's process).
2. After the workers are built: replaces the actor's loss by
   :func:`tokencredit.integrations.verl.tokencredit_ppo_loss`, verl's own ``ppo_loss`` wrapped so
   that the ``tokencredit`` policy loss gets the current policy's entropy and the reference
   log-probs of the micro-batch. The settings travel inside that loss function (pickled by
   Ray), so the workers need no environment variable.
"""

from __future__ import annotations

import logging
from functools import partial

from omegaconf import DictConfig

from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer

from .verl import (
    ESTIMATOR_PREFIX,
    LOSS_MODE,
    TRAINER_MODE,
    VerlCreditSettings,
    check_verl_version,
    estimator_names,
    install_settings,
    settings_from_config,
    tokencredit_ppo_loss,
)
from ..spec import CreditPipeline

__all__ = ["TokenCreditPPOTrainerSync", "check_trainer_config"]

log = logging.getLogger(__name__)


def check_trainer_config(config: DictConfig) -> VerlCreditSettings:
    """The settings of a verl config that selects the trainer mode; a clear error when the rest
    of the config cannot deliver what the credit spec needs."""
    check_verl_version()
    settings = settings_from_config(config)
    if settings.spec is None:
        raise ValueError(
            f"trainer.v1.trainer_mode={TRAINER_MODE} needs a credit spec: add +tokencredit.spec=grpo+taco "
            f"(and per-method keys such as +tokencredit.taco.lam=0.5)"
        )
    pipe = CreditPipeline(settings.spec, {k: dict(v) for k, v in settings.configs.items()})
    algo = config.algorithm.adv_estimator
    est = pipe.estimator.name
    if str(algo).startswith(ESTIMATOR_PREFIX) and algo != ESTIMATOR_PREFIX + est:
        raise ValueError(
            f"algorithm.adv_estimator={algo} but tokencredit.spec '{settings.spec}' starts with '{est}': "
            f"set algorithm.adv_estimator={ESTIMATOR_PREFIX}{est}"
        )
    if algo not in estimator_names():
        # verl's own estimator (e.g. gae) + tokencredit's calibrators in the loss: allowed
        log.warning("tokencredit: algorithm.adv_estimator=%s is verl's; the spec's estimator '%s' is not used", algo, est)
    actor = config.actor_rollout_ref.actor
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    if pipe.calibrators and loss_mode != LOSS_MODE:
        raise ValueError(
            f"tokencredit.spec '{settings.spec}' has calibrators {[c.name for c in pipe.calibrators]}, which run in "
            f"the policy loss: set actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_MODE} (it is {loss_mode})"
        )
    need = pipe.required_signals
    # verl's actor computes entropy in the update pass when calculate_entropy or an entropy bonus is on
    if "entropy" in need and not (actor.get("calculate_entropy", False) or actor.get("entropy_coeff", 0.0) != 0.0):
        raise ValueError(
            f"tokencredit.spec '{settings.spec}' needs the policy entropy: set actor_rollout_ref.actor.calculate_entropy=True"
        )
    if "ref_logprobs" in need:
        from verl.trainer.ppo.utils import need_reference_policy

        if not need_reference_policy(config):
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' needs reference log-probs: enable a reference policy, e.g. "
                f"actor_rollout_ref.actor.use_kl_loss=True (kl_loss_coef may be 0)"
            )
    distillation = config.get("distillation", None)
    if distillation is not None and distillation.get("enabled", False):
        raise ValueError(f"trainer.v1.trainer_mode={TRAINER_MODE} does not combine with distillation (it replaces the actor loss)")
    return settings


@register_trainer(TRAINER_MODE)
class TokenCreditPPOTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` whose actor loss hands entropy and reference log-probs to tokencredit."""

    def __init__(self, config: DictConfig):
        self.tokencredit_settings = check_trainer_config(config)
        install_settings(self.tokencredit_settings)
        super().__init__(config)

    def on_init_end(self):
        from verl.utils.config import omega_conf_to_dataclass

        # the same conversion the actor worker applies to its own copy of this section
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self.actor_rollout_wg.set_loss_fn(
            partial(tokencredit_ppo_loss, config=actor_config, settings=self.tokencredit_settings)
        )
        log.info("tokencredit: actor loss set for credit spec '%s'", self.tokencredit_settings.spec)
        super().on_init_end()
