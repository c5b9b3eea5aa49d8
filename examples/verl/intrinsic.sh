#!/usr/bin/env bash
# ARCA's intrinsic-signal baselines on GRPO: SALIENCE=surprisal | entropy | divergence.
#   surprisal  needs log-probs only (would also run in verl's stock trainer, see the docs);
#   entropy    needs the policy entropy of the update pass (actor.calculate_entropy=True);
#   divergence needs reference log-probs (a reference policy: use_kl_loss=True, coef 0).
source "$(dirname "$0")/common.sh"
SALIENCE=${SALIENCE:-surprisal}

launch "tc_grpo_${SALIENCE}" \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator=tc_grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit \
    actor_rollout_ref.actor.calculate_entropy=True \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    +tokencredit.spec="grpo+${SALIENCE}"
