#!/usr/bin/env bash
# Outcome estimators from tokencredit in verl's stock trainer: METHOD=grpo | rloo | dr_grpo.
# Only `algorithm.adv_estimator` changes; the policy loss is verl's vanilla PPO clip.
source "$(dirname "$0")/common.sh"
METHOD=${METHOD:-grpo}

EXTRA=()
if [[ "$METHOD" == dr_grpo ]]; then
    # Dr. GRPO's second fix lives in the loss: token sums divided by a constant (the budget)
    EXTRA+=(actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm
            actor_rollout_ref.actor.loss_scale_factor="$MAX_RESPONSE")
fi

launch "tc_${METHOD}" \
    algorithm.adv_estimator="tc_${METHOD}" \
    "${EXTRA[@]}"
