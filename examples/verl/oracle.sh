#!/usr/bin/env bash
# OPPO / OPD: METHOD=oppo | opd; ORACLE=self (default) | teacher.
#
# self: the trainer mode builds the oracle-prompted inputs on the driver (the prompt with the
# reference answer from reward_model.ground_truth, which verl's GSM8K preprocessing writes, via
# the method's prompt builder and the run's chat template), scores the batch's own responses with
# the actor's compute_log_prob, and hands the oracle log-probs to tc_oppo / tc_opd.
#
# teacher: verl's own on-policy-distillation teacher servers (vLLM, a resource pool of their own,
# TEACHER_GPUS GPUs per node on top of the trainer's N_GPUS: default 4 + 4 on one 8-GPU node) hold
# TEACHER_MODEL, which must share the actor's tokenizer (checked at start). OPPO's
# teacher-oracle sends each oracle prompt + response to them; OPD reads the teacher log-probs
# verl's agent loop computes for the student's own prompt. The trainer mode's loss replaces verl's
# distillation loss (the teacher reaches the policy through the credit). Teacher log-probs are at
# temperature 1.0, so the rollout temperature must be 1.0 (verl's default).
METHOD=${METHOD:-oppo}
ORACLE=${ORACLE:-self}
if [ "$ORACLE" = teacher ]; then
    # the teacher's pool comes on top of the trainer's: 4 + 4 GPUs on one 8-GPU node by default
    # (the trainer's GPU count must divide train_batch_size x rollout.n, verl checks)
    TEACHER_GPUS=${TEACHER_GPUS:-4}
    N_GPUS=${N_GPUS:-4}
fi
source "$(dirname "$0")/common.sh"

EXTRA=()
if [ "$ORACLE" = teacher ]; then
    TEACHER_MODEL=${TEACHER_MODEL:-Qwen/Qwen2.5-Math-7B-Instruct}
    EXTRA=(
        +tokencredit."${METHOD}".oracle=teacher
        distillation.enabled=True
        distillation.n_gpus_per_node="$TEACHER_GPUS"
        distillation.nnodes=1
        distillation.teacher_models.teacher_model.model_path="$TEACHER_MODEL"
        distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1
        distillation.distillation_loss.loss_mode=k1
        distillation.distillation_loss.use_policy_gradient=True
    )
elif [ "$ORACLE" != self ]; then
    echo "oracle.sh: ORACLE: expected self or teacher, got '$ORACLE'" >&2
    exit 2
fi

launch "tc_${METHOD}_${ORACLE}" \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator="tc_${METHOD}" \
    +tokencredit.spec="${METHOD}" \
    "${EXTRA[@]}"
