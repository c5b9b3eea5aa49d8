#!/usr/bin/env bash
# Critic methods: METHOD=pact | gae (tokencredit's GAE). verl's critic worker (critic.enable=True)
# is trained with the loss the method declares, installed through set_loss_fn: PACT's BCE on the
# [0, 1] reward (sigmoid value head), after each actor update, on the masked per-token IS weights
# of a log-prob pass of the updated actor; GAE's squared error on its returns.
source "$(dirname "$0")/common.sh"
METHOD=${METHOD:-pact}

launch "tc_${METHOD}" \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator="tc_${METHOD}" \
    critic.enable=True \
    critic.model.path="$MODEL" \
    critic.optim.lr=1e-5 \
    critic.ppo_micro_batch_size_per_gpu=8 \
    +tokencredit.spec="${METHOD}"
