#!/usr/bin/env bash
# Worker-side signals: METHOD=acpo | arca. Both calibrators read more of the actor's forward than
# verl's engine returns, so the actor runs tokencredit's FSDP engine, registered in verl's
# EngineRegistry under its own model type (+actor_rollout_ref.model.model_type=...; no patch):
#   acpo  the top-1 probability of the update forward (same logits as the log-probs);
#   arca  under LoRA, ||h_on - h_off|| of the LM head's input, with one extra no-grad forward of
#         each micro-batch inside verl's engine.disable_adapter(); the paper's per-trajectory
#         aggregation (seq-mean-token-mean), which verl's default token-mean would change.
source "$(dirname "$0")/common.sh"
METHOD=${METHOD:-acpo}
if [[ "$METHOD" == arca ]]; then  # a LoRA-sized step (common.sh's 1e-6 is a full fine-tune's)
    COMMON=("${COMMON[@]/actor_rollout_ref.actor.optim.lr=1e-6/actor_rollout_ref.actor.optim.lr=3e-5}")
fi

EXTRA=()
case "$METHOD" in
    acpo) ;;
    arca)
        EXTRA+=(actor_rollout_ref.model.lora_rank=32
                actor_rollout_ref.model.lora_alpha=32
                actor_rollout_ref.model.target_modules=all-linear
                actor_rollout_ref.rollout.load_format=safetensors
                actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean) ;;
    *) echo "METHOD: expected acpo or arca, got $METHOD" >&2; exit 1 ;;
esac

launch "tc_grpo_${METHOD}" \
    trainer.v1.trainer_mode=tokencredit_sync \
    algorithm.adv_estimator=tc_grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit \
    +actor_rollout_ref.model.model_type=tokencredit_language_model \
    +tokencredit.spec="grpo+${METHOD}" \
    "${EXTRA[@]}"
