#!/usr/bin/env bash
# GTPO (gtpo): entropy-shaped token rewards in the estimator. The trainer mode reads the per-token
# entropy of verl's old-log-prob pass (computed there anyway) and hands it to tc_gtpo on the driver.
source "$(dirname "$0")/common.sh"

launch tc_gtpo \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator=tc_gtpo \
    +tokencredit.spec=gtpo
