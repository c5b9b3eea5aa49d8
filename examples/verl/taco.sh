#!/usr/bin/env bash
# TACO (grpo+taco): damps positive credit on tail tokens. Needs the current policy's entropy in
# the loss, which verl's policy-loss API does not pass: the tokencredit_sync trainer mode
# installs a loss wrapper that does (calculate_entropy=True makes the actor compute it).
source "$(dirname "$0")/common.sh"

launch tc_grpo_taco \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator=tc_grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit \
    actor_rollout_ref.actor.calculate_entropy=True \
    +tokencredit.spec=grpo+taco \
    +tokencredit.taco.alpha=0.01 \
    +tokencredit.taco.lam=0.9
