#!/usr/bin/env bash
# Shared setup for the tokencredit x verl examples (verl 0.9.1, v1 trainer, FSDP + vLLM).
#
# Data: verl's GSM8K preprocessing (from the verl repository, not the wheel):
#   python3 examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k
# verl's default reward (verl.utils.reward_score, data_source "openai/gsm8k") scores it.
#
# Override any of these from the environment, e.g. `N_GPUS=4 MODEL=Qwen/Qwen3-1.7B bash taco.sh`.
# DRY_RUN=1 prints the hydra overrides, one per line, instead of launching.
# DEVICE=cpu runs the same launch as a dry run on a CPU machine (docs/integrations.md, "Dry-run a
# verl config on CPU"): tokencredit's CPU platform and transformers rollout (tokencredit.integrations.
# verl_cpu) instead of CUDA and vLLM; shrink the sizes with TRAIN_BATCH, MINI_BATCH, MICRO_BATCH,
# N_SAMPLES, MAX_PROMPT and MAX_RESPONSE and a small MODEL. Extra hydra overrides go after the
# script's: `bash taco.sh trainer.total_training_steps=2`.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-Math-1.5B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}
PROJECT=${PROJECT:-tokencredit_verl}
MAX_RESPONSE=${MAX_RESPONSE:-1024}
MAX_PROMPT=${MAX_PROMPT:-512}
TRAIN_BATCH=${TRAIN_BATCH:-256}
MINI_BATCH=${MINI_BATCH:-64}
MICRO_BATCH=${MICRO_BATCH:-8}
N_SAMPLES=${N_SAMPLES:-8}
LOGPROB_MICRO_BATCH=${LOGPROB_MICRO_BATCH:-16}
DEVICE=${DEVICE:-cuda}
USER_OVERRIDES=("$@")  # the launching script's own arguments: extra hydra overrides, applied last

COMMON=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size="$TRAIN_BATCH"
    data.max_prompt_length="$MAX_PROMPT"
    data.max_response_length="$MAX_RESPONSE"
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH"
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$MICRO_BATCH"
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n="$N_SAMPLES"
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$LOGPROB_MICRO_BATCH"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$LOGPROB_MICRO_BATCH"
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

if [[ "$DEVICE" == cpu ]]; then
    # what differs on a CPU: the platform (gloo, Ray "GPU" slots = worker processes), verl's FSDP2
    # engine with sdpa attention, the transformers rollout, and fewer helper processes
    COMMON+=(
        actor_rollout_ref.rollout.name=tc_hf
        actor_rollout_ref.rollout.dtype="${ROLLOUT_DTYPE:-float32}"
        actor_rollout_ref.actor.strategy=fsdp2
        actor_rollout_ref.ref.strategy=fsdp2
        critic.strategy=fsdp2
        +actor_rollout_ref.model.override_config.attn_implementation=sdpa
        actor_rollout_ref.model.use_remove_padding=False
        actor_rollout_ref.model.enable_gradient_checkpointing=False
        actor_rollout_ref.model.lora.merge=True
        actor_rollout_ref.rollout.agent.num_workers=1
        reward.num_workers=1
        data.dataloader_num_workers=0
        transfer_queue.backend.SimpleStorage.num_data_storage_units=1
        +ray_kwargs.ray_init.num_gpus="$((N_GPUS * NNODES + ${TEACHER_GPUS:-0}))"
        ray_kwargs.ray_init.num_cpus=16
    )
    export VERL_USE_EXTERNAL_MODULES=${VERL_USE_EXTERNAL_MODULES:-tokencredit.integrations.verl_cpu}
    export VERL_PLATFORM=cpu
elif [[ "$DEVICE" != cuda ]]; then
    echo "DEVICE: expected cuda or cpu, got '$DEVICE'" >&2
    exit 2
fi

# launch NAME OVERRIDE... : run verl's PPO entry point (every Ray worker imports verl, and with
# it tokencredit's plugin, through the verl.plugins entry point; nothing else to set up).
launch() {
    local name=$1
    shift
    local args=("${COMMON[@]}" trainer.experiment_name="$name" "$@" "${USER_OVERRIDES[@]}")
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%s\n' "${args[@]}"
    else
        python3 -c 'import tokencredit.integrations.verl' # fails loudly here if the plugin cannot load
        python3 -m verl.trainer.main_ppo "${args[@]}"
    fi
}
