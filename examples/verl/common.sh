#!/usr/bin/env bash
# Shared setup for the tokencredit x verl examples (verl 0.9.1, v1 trainer, FSDP + vLLM).
#
# Data: verl's GSM8K preprocessing (from the verl repository, not the wheel):
#   python3 examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k
# verl's default reward (verl.utils.reward_score, data_source "openai/gsm8k") scores it.
#
# Override any of these from the environment, e.g. `N_GPUS=4 MODEL=Qwen/Qwen3-1.7B bash taco.sh`.
# DRY_RUN=1 prints the hydra overrides, one per line, instead of launching.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-Math-1.5B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}
PROJECT=${PROJECT:-tokencredit_verl}
MAX_RESPONSE=${MAX_RESPONSE:-1024}

COMMON=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length="$MAX_RESPONSE"
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name="$PROJECT"
    trainer.n_gpus_per_node="$N_GPUS"
    trainer.nnodes="$NNODES"
    trainer.save_freq=50
    trainer.test_freq=10
    trainer.total_epochs=15
)

# launch NAME OVERRIDE... : run verl's PPO entry point (every Ray worker imports verl, and with
# it tokencredit's plugin, through the verl.plugins entry point; nothing else to set up).
launch() {
    local name=$1
    shift
    local args=("${COMMON[@]}" trainer.experiment_name="$name" "$@")
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%s\n' "${args[@]}"
    else
        python3 -c 'import tokencredit.integrations.verl' # fails loudly here if the plugin cannot load
        python3 -m verl.trainer.main_ppo "${args[@]}"
    fi
}
