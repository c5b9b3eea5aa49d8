#!/usr/bin/env bash
# STARE (grpo+stare). In verl the top-P selection and the entropy gate see one micro-batch per
# rank, as in the reference code; set STARE's micro-batch through actor.ppo_micro_batch_size_per_gpu.
# ADAPTIVE=True: the controller steps once per step on the driver from the old-log-prob pass's
# entropy, before the actor update; the trainer mode ships W and M to every rank with the loss.
source "$(dirname "$0")/common.sh"
ADAPTIVE=${ADAPTIVE:-False}

launch tc_grpo_stare \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator=tc_grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit \
    actor_rollout_ref.actor.calculate_entropy=True \
    +tokencredit.spec=grpo+stare \
    +tokencredit.stare.variant=O1 \
    +tokencredit.stare.P=0.1 \
    +tokencredit.stare.W=1.1 \
    +tokencredit.stare.H_target=0.3 \
    +tokencredit.stare.adaptive="$ADAPTIVE"
