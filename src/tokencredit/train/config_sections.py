"""The sections of a training config: one typed dataclass each (model, task, data, reward,
rollout, optim, loss, critic, dapo, log).

Each field's comment is its ``--help`` text (tyro reads it); types and ranges are checked by
``config_fields.check_section`` when ``TrainConfig`` (``tokencredit.train.config``, which re-exports
every section) is built or validated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Tuple

__all__ = ["CriticConfig", "DapoConfig", "DataConfig", "LogConfig", "LossConfig", "ModelConfig", "OptimConfig",
           "RewardConfig", "RolloutConfig", "TaskConfig"]


@dataclass
class ModelConfig:
    name: str = "embedded:smollm2-135m-instruct"  # the policy: an embedded model, a hub id or a local path
    cache_dir: Optional[str] = None  # where the embedded GGUF is converted once ($TOKENCREDIT_CACHE)
    lora: bool = False  # ARCA requires LoRA
    lora_r: int = 16  # LoRA rank r
    lora_alpha: int = 32  # LoRA alpha: the adapter's update is scaled by alpha / r (peft)
    lora_targets: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # modules the adapter wraps
    reference: Optional[str] = None  # frozen reference model for KL / divergence ("self" = initial policy)
    teacher: Optional[str] = None  # frozen teacher for OPD / OPPO teacher-oracle


@dataclass
class TaskConfig:
    name: str = "mul1"  # add1, add2, mul1, word, mix, gsm8k, math
    path: Optional[str] = None  # local jsonl/parquet for gsm8k/math
    reward_fn: Optional[str] = None  # "package.module:function", replaces the task's reward
    # seconds a reward function may take per completion (a call on N completions: N times this);
    # a slower call is ended (its worker process killed) and counts as a failure
    reward_timeout_s: float = 5.0
    n_train: int = 512  # training prompts
    n_eval: int = 32  # held-out prompts for evaluation


@dataclass
class DataConfig:
    """Own data, read through ``datasets`` (tokencredit.data.datasource); set ``path`` to use it
    instead of task.name's built-in task."""

    path: Optional[str] = None  # a .json/.jsonl/.csv/.parquet file, a folder of them, or a hub id owner/name[:config]
    split: str = "train"  # the training split (a single file is one split, train)
    eval_path: Optional[str] = None  # evaluation rows from another file, folder or hub id
    eval_split: Optional[str] = None  # the evaluation split (of eval_path, else of path)
    # the share of the training rows held out for evaluation when no eval split is given or found (None: 0.1)
    eval_fraction: Optional[float] = None
    prompt_column: str = "prompt"  # the prompt: a string, or a list of chat messages (TRL's conversational format, verl's prompt)
    # the reference answer (a dotted name reaches into a mapping: reward_model.ground_truth); None: answer, solution or reward_model.ground_truth if present
    answer_column: Optional[str] = None
    system_prompt: Optional[str] = None  # a system message put before every prompt
    # the user text as sent, with {prompt} for the row's prompt, e.g. "{prompt} Put your final answer within \\boxed{}."; None: the prompt as it is
    prompt_template: Optional[str] = None


@dataclass
class RewardConfig:
    """Reward functions with TRL's contract (tokencredit.data.rewards); unset: the task's own reward."""

    # built-in names (math, numeric) or "module:function" / "file.py:function" taking TRL's keyword arguments
    funcs: Tuple[str, ...] = ()
    weights: Tuple[float, ...] = ()  # one weight per function (default 1.0 each), as TRL's reward_weights
    # stop the run when a function fails on every completion of this many consecutive steps
    max_failing_steps: int = 2
    # warn when more than this share of completions hit rollout.max_new_tokens (completions/clipped_ratio)
    clipped_warn_ratio: float = 0.5


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4  # prompts per training step, each sampled samples_per_prompt times
    samples_per_prompt: int = 4  # K, the group size
    max_new_tokens: int = 32  # generation budget per response
    temperature: float = 0.7  # ecosystem: T=1.0 removes almost all signal on a 135M model
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    # rows per generate call (a step's prompts x samples, or eval's prompts, in as few calls as
    # this allows; prompts bucketed by length). Decode tokens/s grows with the batch up to ~64-128
    # rows on a CPU (benchmarks/decode.py); the returned logits take rows x max_new_tokens x vocab floats
    max_batch_size: int = 64
    # how generate draws a token: inverse_cdf (one uniform per row in the cumulative distribution,
    # docs/performance.md) or multinomial (HF generate's torch.multinomial, an exponential per
    # vocabulary entry: the random stream of earlier versions). Same distribution, different samples.
    sampler: Literal["inverse_cdf", "multinomial"] = "inverse_cdf"
    # the generation engine: hf (transformers generate, HFRollout) or vllm (an in-process vLLM
    # engine, tokencredit.engine.rollout_vllm; needs the vllm extra: pip install 'tokencredit[vllm]')
    backend: Literal["hf", "vllm"] = "hf"
    # vllm only (verl's rollout.enforce_eager): true runs vLLM's model eagerly; false lets vLLM
    # compile it (torch.compile, and CUDA graphs on a GPU, vLLM's own default there): on a 2-core
    # CPU the engine's build takes ~100 s more and decode at batch 128 runs ~1.2x faster
    # (docs/performance.md), so it pays off over long runs; on a GPU it is the usual choice
    enforce_eager: bool = True


@dataclass
class OptimConfig:
    lr: float = 2e-6  # AdamW learning rate of the policy
    weight_decay: float = 0.0  # AdamW weight decay
    betas: Tuple[float, float] = (0.9, 0.99)  # AdamW betas
    warmup_steps: int = 0  # linear learning-rate warm-up from 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # learning rate after the warm-up
    max_grad_norm: float = 1.0  # gradient-norm clip
    micro_batch_size: int = 8  # responses per forward/backward; gradients accumulate over the batch
    ppo_epochs: int = 1  # optimizer steps per rollout batch, each against the rollout's log-probs
    # with ppo_epochs=1, the policy pass's signals (old log-probs, entropy, top-1 probability) come
    # from the update's own forward, detached, instead of a separate no-grad pass
    # (passes.update_gives); holds every micro-batch's graph until the credit is computed
    one_pass: bool = True
    # torch's fused AdamW kernel (one pass over each parameter instead of a dozen foreach
    # kernels: 0.16 s against 0.67 s per step for SmolLM2-135M on one CPU thread); the update is
    # the same algorithm. Turned off by hand, or automatically on devices without the kernel.
    fused_adamw: bool = True


@dataclass
class LossConfig:
    policy_loss: str = "ppo"  # ppo | sapo | cispo | clip_cov | kl_cov (tokencredit.credit.losses registry)
    # None = the policy loss's own default: token-mean for ppo (verl's default, DAPO's token-level
    # loss), seq-mean-token-mean for sapo (as verl hard-codes it)
    agg_mode: Optional[str] = None
    norm_constant: Optional[float] = None  # C of seq-mean-token-sum-norm (Dr. GRPO: the generation budget); None = padded length
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low (PPO)
    clip_high: float = 0.28  # DAPO clip-higher, also TACO's and STARE's recipe
    dual_clip: Optional[float] = None  # dual-clip constant c > 1 for negative advantages; None = off
    # TRL's importance_sampling_level: token | sequence (GSPO's length-normalised sequence ratio;
    # the GSPO paper clips it at clip_low 3e-4, clip_high 4e-4); ppo and cispo
    importance_sampling_level: str = "token"
    # cispo: the cap on the importance weight (TRL's epsilon_high for loss_type="cispo"); None = 5.0
    epsilon_high: Optional[float] = None
    # clip_cov: the share of tokens whose gradient is cut, drawn at random among those with
    # clip_cov_lb < (A - mean A)(log p - mean log p) < clip_cov_ub; None = verl's 0.0002
    clip_cov_ratio: Optional[float] = None
    clip_cov_lb: Optional[float] = None  # clip_cov: lower end of the covariance band; None = verl's 1.0
    clip_cov_ub: Optional[float] = None  # clip_cov: upper end of the covariance band; None = verl's 5.0
    # kl_cov: the share of tokens of largest covariance (A - mean A)(log p - mean log p) that get the
    # penalty ppo_kl_coef * |log ratio|; None = verl's 0.0002 (the authors' recipe for 7B: 0.002)
    kl_cov_ratio: Optional[float] = None
    ppo_kl_coef: Optional[float] = None  # kl_cov: the penalty's coefficient; None = verl's 0.1 (the authors' function: 1.0)
    # rollout correction (verl's rollout_correction names), against the sampler's log-probs (a bf16
    # generation copy): truncated importance sampling, one weight per token or per sequence (TIS)
    rollout_is: Optional[Literal["token", "sequence"]] = None
    rollout_is_threshold: float = 2.0  # TIS: the weights are truncated at this value (verl's default)
    rollout_is_batch_normalize: bool = False  # TIS: divide the weights by their batch mean
    # masked importance sampling (MIS): tokens or rows out of bounds leave the loss; comma-separated
    # token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 (verl's rollout_rs)
    rollout_rs: Optional[str] = None
    # MIS: the bound of every rollout_rs option (k1: the ratio within [1/u, u]; k2, k3: divergence <= u)
    rollout_rs_threshold: Optional[float] = None
    kl_coef: float = 0.0  # TACO/DAPO recipe: no KL
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL to the reference)


@dataclass
class CriticConfig:
    """Value head for gae and pact (a linear head on the policy's detached final hidden states)."""

    lr: float = 1e-3  # AdamW learning rate of the value head
    steps: int = 1  # critic optimisation steps per training step
    # PACT's importance-sampling range is PACT's own setting: --credit-config.pact.is-low / .is-high


@dataclass
class DapoConfig:
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, regenerate to fill
    max_rounds: int = 3  # bounded regeneration
    overlong_shaping: bool = False  # DAPO's soft overlong punishment on responses near max_new_tokens
    # C: the penalty ramps over the last C tokens before max_new_tokens. None = max_new_tokens // 5,
    # the DAPO paper's proportion (a 4096-token cache on a 20480-token maximum)
    overlong_cache: Optional[int] = None


@dataclass
class LogConfig:
    eval_every: int = 10  # evaluate every N steps (and at the last)
    # evaluate once before the first step (logged as step 0): the baseline a run's curves start from
    eval_at_start: bool = True
    eval_samples: int = 4  # k for mean@k
    save_rollouts: bool = True  # save each evaluated step's rollout batch under eval/ (tokencredit inspect)
    tensorboard: bool = False  # TensorBoard logs under output_dir
    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "tokencredit"  # the W&B project (with --log.wandb)
    progress: bool = True  # a progress bar on stderr
