#!/usr/bin/env bash
# OPPO / OPD with the self-oracle: METHOD=oppo | opd. The trainer mode builds the oracle-prompted
# inputs on the driver (the prompt with the reference answer from reward_model.ground_truth, which
# verl's GSM8K preprocessing writes, via the method's prompt builder and the run's chat template),
# scores the batch's own responses with the actor's compute_log_prob, and hands the oracle
# log-probs to tc_oppo / tc_opd. A teacher-scored oracle (oracle=teacher) is refused in verl.
source "$(dirname "$0")/common.sh"
METHOD=${METHOD:-oppo}

launch "tc_${METHOD}" \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator="tc_${METHOD}" \
    +tokencredit.spec="${METHOD}"
