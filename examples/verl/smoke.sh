#!/usr/bin/env bash
# Smoke run of every seed method in verl, for users with a GPU: ONE GPU, a small hub model, a toy
# arithmetic data set this script writes itself, 2 training steps per method; prints per method
# its time per step, mean reward and the credit metrics it logged (tokencredit/*, critic/*).
#
# Needs: one GPU (an H200-class GPU runs all methods in well under 10 minutes), network access to
# fetch the model, `pip install "tokencredit[verl]"` with Ray and vLLM. NOT RUN by the tokencredit
# developers (no GPU); its dry run is tested: `DRY_RUN=1 bash examples/verl/smoke.sh` prints one
# command line per method, each checked against verl's own config loader in
# tests/test_verl_methods.py.
#
#   METHODS="gtpo pact" bash examples/verl/smoke.sh     # a subset
#
# oppo and opd run with the self-oracle here: the teacher-oracle needs verl's distillation teacher
# servers in a GPU pool of their own (a second GPU); see `ORACLE=teacher bash oracle.sh`.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-/tmp/tokencredit_verl_smoke}
STEPS=${STEPS:-2}
METHODS=${METHODS:-"grpo gtpo taco stare acpo arca oppo opd pact gae"}

COMMON=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=8
    data.max_prompt_length=256
    data.max_response_length=128
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.calculate_entropy=True
    actor_rollout_ref.actor.policy_loss.loss_mode=tokencredit
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
    algorithm.use_kl_in_reward=False
    trainer.v1.trainer_mode=tokencredit_sync
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name=tokencredit_smoke
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=-1
    trainer.val_before_train=False
    trainer.total_training_steps="$STEPS"
    trainer.total_epochs=1
)
# tokencredit's actor engine (ACPO's top-1 probability, ARCA's adapter-on/off residual)
ENGINE=(+actor_rollout_ref.model.model_type=tokencredit_language_model)
LORA=(
    actor_rollout_ref.model.lora_rank=16
    actor_rollout_ref.model.lora_alpha=32
    actor_rollout_ref.model.target_modules=all-linear
    actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean
)
LORA_LR=2e-5  # a LoRA adapter starts at B = 0 (ARCA's residual is 0 until it moves): a LoRA-sized step
CRITIC=(
    critic.enable=True
    critic.model.path="$MODEL"
    critic.optim.lr=1e-5
    critic.ppo_mini_batch_size=8
    critic.ppo_micro_batch_size_per_gpu=8
)

# the overrides of one method
method_args() {
    case "$1" in
        grpo)  echo algorithm.adv_estimator=tc_grpo +tokencredit.spec=grpo ;;
        gtpo)  echo algorithm.adv_estimator=tc_gtpo +tokencredit.spec=gtpo ;;
        taco)  echo algorithm.adv_estimator=tc_grpo +tokencredit.spec=grpo+taco ;;
        stare) echo algorithm.adv_estimator=tc_grpo +tokencredit.spec=grpo+stare +tokencredit.stare.adaptive=True ;;
        acpo)  echo algorithm.adv_estimator=tc_grpo +tokencredit.spec=grpo+acpo "${ENGINE[@]}" ;;
        arca)  echo algorithm.adv_estimator=tc_grpo +tokencredit.spec=grpo+arca "${ENGINE[@]}" "${LORA[@]}" ;;
        oppo)  echo algorithm.adv_estimator=tc_oppo +tokencredit.spec=oppo ;;
        opd)   echo algorithm.adv_estimator=tc_opd +tokencredit.spec=opd ;;
        pact)  echo algorithm.adv_estimator=tc_pact +tokencredit.spec=pact "${CRITIC[@]}" ;;
        gae)   echo algorithm.adv_estimator=tc_gae +tokencredit.spec=gae "${CRITIC[@]}" ;;
        *) echo "unknown method $1" >&2; return 1 ;;
    esac
}

command_of() {  # the full command line of one method, shell-quoted
    local m=$1
    # shellcheck disable=SC2207
    local args=("${COMMON[@]}" trainer.experiment_name="smoke_$m" $(method_args "$m"))
    if [[ "$m" == arca ]]; then args=("${args[@]/actor_rollout_ref.actor.optim.lr=1e-6/actor_rollout_ref.actor.optim.lr=$LORA_LR}"); fi
    printf 'python3 -m verl.trainer.main_ppo'
    printf ' %q' "${args[@]}"
    printf '\n'
}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    for m in $METHODS; do command_of "$m"; done
    exit 0
fi

python3 -c 'import tokencredit.integrations.verl'  # fails loudly here if the plugin cannot load
mkdir -p "$DATA_DIR"
# toy arithmetic in verl's GSM8K layout: the reward is verl's gsm8k rule ("#### <answer>"), the
# reference answer sits in reward_model.ground_truth (read by the OPPO/OPD oracle prompt)
python3 - "$DATA_DIR" <<'PY'
import random, sys
import pandas as pd
rng = random.Random(0)
def rows(n, split):
    out = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        q = f"What is {a} + {b}? Think briefly, then give the answer after '####'."
        out.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"split": split, "index": i}})
    return pd.DataFrame(out)
rows(256, "train").to_parquet(f"{sys.argv[1]}/train.parquet")
rows(32, "test").to_parquet(f"{sys.argv[1]}/test.parquet")
PY

SUMMARY=()
for m in $METHODS; do
    log="$DATA_DIR/$m.log"
    start=$(date +%s)
    eval "$(command_of "$m")" >"$log" 2>&1 || { echo "== $m FAILED, see $log"; SUMMARY+=("$m: FAILED"); continue; }
    secs=$(( $(date +%s) - start ))
    step=$(grep -o "timing_s/step:[0-9.]*" "$log" | tail -1 | cut -d: -f2)
    reward=$(grep -o "critic/score/mean:[-0-9.]*" "$log" | tail -1 | cut -d: -f2)
    credit=$(grep -o "\(tokencredit\|critic/vf_loss\|critic/vpred_mean\)[^ ]*:[-0-9.e]*" "$log" | sort -u -t: -k1,1 | tr '\n' ' ')
    SUMMARY+=("$m: ${secs}s total, step ${step:-?}s, reward ${reward:-?}; ${credit}")
done
printf '%s\n' "${SUMMARY[@]}"
