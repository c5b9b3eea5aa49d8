"""``trainer.v1.trainer_mode=tokencredit_sync``: verl's synchronous PPO trainer, plus the passes a
credit spec's methods declare.

Uses only verl 0.9's extension points: ``register_trainer`` (the v1 trainer registry),
``PPOTrainerSync`` (subclassed: ``__init__``, the ``on_init_end`` hook and the step methods
``_compute_advantage``, ``_update_critic``, ``_update_actor``, ``_save_checkpoint``,
``_load_checkpoint`` are extended, each calling verl's own), the workers' public ``set_loss_fn``
and ``compute_log_prob`` methods, and TransferQueue's ``kv_batch_get`` / ``kv_batch_put``.

What runs is read from the methods' declarations (``tokencredit.credit.plan.plan_signals``), never from
method names:

* **entropy / log-probs for an estimator** (GTPO): verl's old-log-prob pass computes the
  per-token entropy (always, ``calculate_entropy=True``) and keeps it in TransferQueue; the trainer
  reads it back with ``old_log_probs`` and hands both to the ``tc_*`` estimator
  (``core.driver_signals``).
* **state** (STARE's adaptive controller): stepped once per step on the driver from the step's
  pre-update batch (the old-log-prob pass's entropy), before the actor update, then shipped to
  the actor ranks with the loss function (``set_loss_fn``), so every rank's loss reads the same
  updated W and M. Saved as ``global_step_N/tokencredit_state.json`` and restored on resume.
* **oracle pass** (OPPO, OPD): the oracle-prompted inputs are built on the driver
  (:mod:`.oracle`), written to TransferQueue partition ``tokencredit_oracle`` and scored by the
  actor's ``compute_log_prob`` (self-oracle), or sent to verl's on-policy-distillation teacher
  servers (``oracle=teacher``, ``distillation.enabled=True``; a teacher on the student's own
  prompt reads the log-probs verl's agent loop already computed); the estimator gets the oracle
  log-probs.
* **worker signals** (ACPO's ``mode_prob``, ARCA's ``hidden_residual``): the actor update asks
  tokencredit's actor engine (:mod:`.engine`, selected by ``actor_rollout_ref.model.model_type``)
  for them through the batch's ``extra_info`` (one non-tensor key each, removed after the update);
  the engine returns them in ``model_output`` and the loss hands them to the calibrators.
* **critic** (PACT, tokencredit's GAE): verl's critic worker (``critic.enable=True``) with the
  loss the estimator declares installed by ``set_loss_fn`` (``core.tokencredit_value_loss``); its
  values reach the estimator through the declared transform (PACT: sigmoid). A critic declared
  ``after_actor`` (PACT) is trained after the actor update, on IS weights computed from a log-prob
  pass of the *updated* actor (``CriticSpec.is_weights``).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Dict, Mapping, Optional, Tuple

import torch
from omegaconf import DictConfig

from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer

from ...credit.plan import PlanError, SignalPlan, plan_signals
from ...train.records import RolloutsRecord
from ...credit.spec import CreditPipeline, credit_batch
from ...credit.spec import load_credit_state as spec_load_credit_state
from ...credit.spec import save_credit_state as spec_save_credit_state
from .core import (
    CRITIC_WEIGHTS_FIELD,
    ENGINE_MODEL_TYPE,
    ESTIMATOR_PREFIX,
    LOSS_MODE,
    TRAINER_MODE,
    WORKER_SIGNAL_KEYS,
    VerlCreditSettings,
    check_supported,
    check_verl_version,
    driver_signals,
    estimator_names,
    install_settings,
    pop_estimator_metrics,
    settings_from_config,
    tokencredit_ppo_loss,
    tokencredit_value_loss,
)
from .oracle import oracle_prompt_ids, oracle_samples, response_logprobs, teacher_response_logprobs
from .record import RECORD_FIELDS, padded, rollouts_record

__all__ = [
    "TokenCreditPPOTrainerSync",
    "check_trainer_config",
    "trainer_plan",
    "worker_signals",
    "step_credit_state",
    "critic_values",
    "STATE_FILE",
    "ORACLE_PARTITION",
]

log = logging.getLogger(__name__)

#: the credit state file in each verl checkpoint folder (global_step_N/)
STATE_FILE = "tokencredit_state.json"
#: the TransferQueue partition the oracle inputs live in for the duration of one pass
ORACLE_PARTITION = "tokencredit_oracle"


def _uses_lora(config: DictConfig) -> bool:
    model = config.actor_rollout_ref.model
    rank = model.get("lora", {}).get("rank", 0) or model.get("lora_rank", 0)
    return rank > 0 or model.get("lora_adapter_path") is not None


def _teacher_servers(config: DictConfig) -> bool:
    """Whether verl's on-policy-distillation teacher servers are configured (``distillation.enabled``)."""
    d = config.get("distillation", None)
    return d is not None and bool(d.get("enabled", False))


def trainer_plan(config: DictConfig, settings: VerlCreditSettings) -> Tuple[CreditPipeline, SignalPlan]:
    """The spec's pipeline (the driver's copy, which holds its state) and its plan of passes."""
    pipe = CreditPipeline(settings.spec, {k: dict(v) for k, v in settings.configs.items()})
    check_supported(pipe)
    lora = _uses_lora(config)
    adapter_readers = [m.name for m in pipe.methods if m.needs_adapter]
    if adapter_readers and not lora:
        raise ValueError(
            f"tokencredit.spec '{settings.spec}': {adapter_readers} read the LoRA adapter's effect; expected a LoRA actor "
            f"(actor_rollout_ref.model.lora_rank > 0), got none"
        )
    teacher = _teacher_servers(config)
    try:
        plan = plan_signals(pipe, lora=lora, teacher=teacher)
    except PlanError:
        if teacher:
            raise ValueError(
                f"distillation.enabled: tokencredit.spec '{settings.spec}' has no teacher-scored pass, and the trainer mode "
                f"replaces verl's actor loss (verl's distillation loss would not run); expected distillation.enabled=False, "
                f"or the method's oracle=teacher (e.g. +tokencredit.{pipe.estimator.name}.oracle=teacher), got True"
            ) from None
        raise ValueError(
            f"distillation.enabled: tokencredit.spec '{settings.spec}' has {pipe.estimator.name}.oracle='teacher', scored "
            f"by verl's distillation teacher servers; expected distillation.enabled=True with "
            f"distillation.teacher_models.teacher_model.model_path, distillation.n_gpus_per_node and distillation.nnodes, "
            f"got False"
        ) from None
    return pipe, plan


def teacher_model_path(config: DictConfig) -> str:
    """The model path of the (one) teacher of verl's distillation section."""
    models = config.distillation.teacher_models
    keys = list(models.keys())
    key = keys[0] if len(keys) == 1 else next(k for k in keys if k != "teacher_model")
    return models[key].model_path


def check_same_tokenizer(actor_tokenizer, teacher_tokenizer, teacher_path: str) -> None:
    """The teacher scores the actor's token ids, so the two vocabularies must be the same mapping:
    verl's teacher echoes back the ids it is given, so a different vocabulary would give aligned
    but meaningless log-probs."""
    a, t = actor_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if a != t:
        diff = sorted(set(a.items()) ^ set(t.items()), key=lambda kv: kv[1])
        raise ValueError(
            f"distillation.teacher_models: expected a teacher with the actor's tokenizer ({len(a)} tokens), got "
            f"{teacher_path} with {len(t)} tokens, {len(diff)} (token, id) pairs differing, e.g. {diff[:3]}"
        )


def check_teacher_config(config: DictConfig, spec: str) -> None:
    """What a teacher-scored oracle needs of verl's distillation section and rollout."""
    from verl.trainer.distillation.losses import get_distillation_loss_settings

    d = config.distillation
    teachers = list(d.get("teacher_models", {}).keys())
    # verl drops its default entry "teacher_model" when others are added (DistillationConfig)
    effective = teachers if len(teachers) == 1 else [t for t in teachers if t != "teacher_model"]
    if len(effective) != 1:
        raise ValueError(
            f"distillation.teacher_models: tokencredit.spec '{spec}' scores its oracle with one teacher; expected one "
            f"entry, got {effective}"
        )
    mode = d.distillation_loss.get("loss_mode", "k3")
    if get_distillation_loss_settings(mode).use_topk:
        raise ValueError(
            f"distillation.distillation_loss.loss_mode: the teacher must return the sampled token's log-prob; expected a "
            f"non-top-k mode (e.g. k1 or k3), got {mode}"
        )
    temp = float(config.actor_rollout_ref.rollout.get("temperature", 1.0))
    if temp != 1.0:
        raise ValueError(
            f"actor_rollout_ref.rollout.temperature: verl's teacher servers score at temperature 1.0 and tokencredit "
            f"scores an oracle at the rollout temperature; expected 1.0 with a teacher-scored oracle, got {temp}"
        )


def worker_signals(plan: SignalPlan) -> Tuple[str, ...]:
    """The signals the actor's forward must return to the loss (tokencredit's engine, :mod:`.engine`),
    from the plan's passes: the policy pass's top-1 probability, the adapter-off pass's hidden state."""
    out = []
    if "mode_prob" in plan.policy:
        out.append("mode_prob")
    if "hidden" in plan.adapter_off:
        out.append("hidden_residual")
    return tuple(out)


def check_trainer_config(config: DictConfig) -> VerlCreditSettings:
    """The settings of a verl config that selects the trainer mode; a clear error when the rest
    of the config cannot deliver what the credit spec needs."""
    check_verl_version()
    settings = settings_from_config(config)
    if settings.spec is None:
        raise ValueError(
            f"trainer.v1.trainer_mode={TRAINER_MODE} needs a credit spec: add +tokencredit.spec=grpo+taco "
            f"(and per-method keys such as +tokencredit.taco.lam=0.5)"
        )
    pipe, plan = trainer_plan(config, settings)
    algo = config.algorithm.adv_estimator
    est = pipe.estimator.name
    if str(algo).startswith(ESTIMATOR_PREFIX) and algo != ESTIMATOR_PREFIX + est:
        raise ValueError(
            f"algorithm.adv_estimator={algo} but tokencredit.spec '{settings.spec}' starts with '{est}': "
            f"set algorithm.adv_estimator={ESTIMATOR_PREFIX}{est}"
        )
    if algo not in estimator_names():
        if pipe.estimator.requires:
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' starts with '{est}', whose signals the trainer mode computes "
                f"for its verl estimator: set algorithm.adv_estimator={ESTIMATOR_PREFIX}{est} (it is {algo})"
            )
        # verl's own estimator (e.g. gae) + tokencredit's calibrators in the loss: allowed
        log.warning("tokencredit: algorithm.adv_estimator=%s is verl's; the spec's estimator '%s' is not used", algo, est)
    actor = config.actor_rollout_ref.actor
    loss_mode = actor.policy_loss.get("loss_mode", "vanilla")
    if pipe.calibrators and loss_mode != LOSS_MODE:
        raise ValueError(
            f"tokencredit.spec '{settings.spec}' has calibrators {[c.name for c in pipe.calibrators]}, which run in "
            f"the policy loss: set actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_MODE} (it is {loss_mode})"
        )
    # calibrators run in the loss and read the update pass's signals; estimators read the driver's
    need = set()
    for c in pipe.calibrators:
        need |= c.requires
    # verl's actor computes entropy in the update pass when calculate_entropy or an entropy bonus is on
    if "entropy" in need and not (actor.get("calculate_entropy", False) or actor.get("entropy_coeff", 0.0) != 0.0):
        raise ValueError(
            f"tokencredit.spec '{settings.spec}' needs the policy entropy: set actor_rollout_ref.actor.calculate_entropy=True"
        )
    if "ref_logprobs" in need:
        from verl.trainer.ppo.utils import need_reference_policy

        if not need_reference_policy(config):
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' needs reference log-probs: enable a reference policy, e.g. "
                f"actor_rollout_ref.actor.use_kl_loss=True (kl_loss_coef may be 0)"
            )
    if plan.critic is not None:
        from verl.trainer.ppo.utils import need_critic

        if not need_critic(config):
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' reads a critic's values: set critic.enable=True (verl's critic "
                f"worker, trained with the loss the method declares)"
            )
        if config.algorithm.get("use_kl_in_reward", False):
            raise ValueError(
                f"tokencredit.spec '{settings.spec}': its critic is trained on the outcome reward itself; "
                f"set algorithm.use_kl_in_reward=False (use the actor's KL loss instead)"
            )
        if plan.critic.after_actor and config.trainer.get("critic_warmup", 0) != 0:
            raise ValueError(
                f"tokencredit.spec '{settings.spec}': its critic trains after each actor update; set "
                f"trainer.critic_warmup=0 (it is {config.trainer.critic_warmup})"
            )
    worker = worker_signals(plan)
    if worker:
        model = config.actor_rollout_ref.model
        if model.get("model_type", "language_model") != ENGINE_MODEL_TYPE:
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' needs {list(worker)} from the actor's forward: set "
                f"+actor_rollout_ref.model.model_type={ENGINE_MODEL_TYPE} (tokencredit's FSDP actor engine; it is "
                f"{model.get('model_type', 'language_model')})"
            )
        if actor.get("strategy", "fsdp") not in ("fsdp", "fsdp2"):
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' needs {list(worker)} from tokencredit's FSDP actor engine: set "
                f"actor_rollout_ref.actor.strategy=fsdp or fsdp2 (it is {actor.get('strategy')})"
            )
        if model.get("use_fused_kernels", False):
            raise ValueError(
                f"tokencredit.spec '{settings.spec}' needs {list(worker)}, which verl's fused kernels never materialise: "
                f"set actor_rollout_ref.model.use_fused_kernels=False"
            )
    agg = pipe.loss_default("agg_mode")
    if agg is not None and actor.get("loss_agg_mode", "token-mean") != agg:
        # verl's default (token-mean) cannot be told apart from a user's choice: say it, do not override
        log.warning(
            "tokencredit: spec '%s' is defined with loss aggregation %s; verl runs actor_rollout_ref.actor.loss_agg_mode=%s",
            settings.spec, agg, actor.get("loss_agg_mode", "token-mean"),
        )
    rc = config.algorithm.get("rollout_correction", None)
    if plan.policy and rc is not None and rc.get("bypass_mode", False) and {"entropy"} & set(pipe.estimator.requires):
        raise ValueError(
            f"tokencredit.spec '{settings.spec}' needs the old-log-prob pass's entropy, which rollout_correction."
            f"bypass_mode=True skips"
        )
    if plan.oracle is not None and plan.oracle.scorer == "teacher":
        check_teacher_config(config, settings.spec)
        log.warning(
            "tokencredit: spec '%s' scores its oracle with verl's distillation teacher; the trainer mode's loss replaces "
            "verl's distillation loss (distillation.distillation_loss is not applied)", settings.spec,
        )
    return settings


# -- pure driver-side steps (tested on CPU) -------------------------------------------------


def step_credit_state(credit: CreditPipeline, response_mask: torch.Tensor, signals: Mapping[str, torch.Tensor],
                      rewards: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """One controller step of every stateful method of ``credit`` from the step batch: the
    signals of the pre-update old-log-prob pass the controllers declare (``state_signals``) and
    each row's outcome ``rewards`` (the summed reward-model scores, before any KL penalty; a
    controller may read them, as SEPA's correctness gate does). Returns the controllers' metrics. Rows are not
    grouped for this (controllers read batch statistics only)."""
    if rewards is not None:
        rewards = rewards.detach().float()
    return credit.update_state(credit_batch(response_mask.bool(), signals, need=credit.state_signals, rewards=rewards))


def critic_values(plan: SignalPlan, raw_values: torch.Tensor) -> torch.Tensor:
    """The critic's values as the estimator reads them: the declared transform of the head output."""
    if plan.critic is None:
        raise ValueError("critic_values: the plan has no critic")
    return torch.sigmoid(raw_values.float()) if plan.critic.transform == "sigmoid" else raw_values.float()


def save_credit_state(folder: str, credit: CreditPipeline) -> str:
    """``folder/tokencredit_state.json`` (:func:`tokencredit.credit.spec.save_credit_state`'s format)."""
    return str(spec_save_credit_state(os.path.join(folder, STATE_FILE), credit))


def load_credit_state(folder: str, credit: CreditPipeline) -> bool:
    """Restore ``credit``'s state from a checkpoint folder; False (and a warning) without a file."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        log.warning("tokencredit: %s has no %s; the credit state starts fresh", folder, STATE_FILE)
        return False
    spec_load_credit_state(path, credit)
    return True


def _rows_to_width(rows, real, batch_size: int, width: int) -> torch.Tensor:
    """Per-row response log-probs laid out right-padded as [batch_size, width]; rows not in
    ``real`` (verl's synthetic padding samples) are 0."""
    out = torch.zeros(batch_size, width)
    for r, i in zip(rows, real):
        if r.shape[0] > width:
            raise ValueError(f"oracle log-probs of row {i}: expected at most {width} response tokens, got {r.shape[0]}")
        out[i, : r.shape[0]] = r
    return out


# -- the trainer mode -----------------------------------------------------------------------


@register_trainer(TRAINER_MODE)
class TokenCreditPPOTrainerSync(PPOTrainerSync):
    """``PPOTrainerSync`` plus the passes, state and critic loss the credit spec declares."""

    def __init__(self, config: DictConfig):
        self.tokencredit_settings = check_trainer_config(config)
        install_settings(self.tokencredit_settings)
        self.tokencredit_credit, self.tokencredit_plan = trainer_plan(config, self.tokencredit_settings)
        if self.tokencredit_plan.oracle is not None and self.tokencredit_plan.oracle.scorer == "teacher":
            # before any worker starts: the teacher must score the actor's token ids
            from verl.utils import hf_tokenizer
            from verl.utils.fs import copy_to_local

            trust = config.actor_rollout_ref.model.get("trust_remote_code", False)
            tok = lambda p: hf_tokenizer(copy_to_local(p), trust_remote_code=trust)  # noqa: E731
            path = teacher_model_path(config)
            model = config.actor_rollout_ref.model
            check_same_tokenizer(tok(model.get("tokenizer_path", None) or model.path), tok(path), path)
        super().__init__(config)

    # -- losses shipped to the workers ---------------------------------------------------------

    def _tc_set_actor_loss(self) -> None:
        credit = self.tokencredit_credit
        self.actor_rollout_wg.set_loss_fn(
            partial(
                tokencredit_ppo_loss,
                config=self._tc_actor_config,
                settings=self.tokencredit_settings,
                credit_state=credit.state_dict() if credit.states else None,
            )
        )

    def on_init_end(self):
        from verl.utils.config import omega_conf_to_dataclass

        # the same conversion the actor worker applies to its own copy of this section
        self._tc_actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self._tc_set_actor_loss()
        if self.tokencredit_plan.critic is not None:
            critic_cfg = omega_conf_to_dataclass(self.config.critic)
            self.critic_wg.set_loss_fn(partial(tokencredit_value_loss, config=critic_cfg, settings=self.tokencredit_settings))
        log.info("tokencredit: credit spec '%s', passes %s", self.tokencredit_settings.spec, self.tokencredit_plan.passes)
        super().on_init_end()

    # -- driver-side signals, state and the oracle pass ------------------------------------------

    def _compute_advantage(self, batch, metrics: dict):
        import transfer_queue as tq

        credit, plan = self.tokencredit_credit, self.tokencredit_plan
        need = set(credit.estimator.requires) | set(credit.state_signals)
        if not need and not credit.states:
            return self._tc_estimate(batch, metrics)
        fields = ["response_mask"]
        fields += ["rm_scores"] if credit.states else []  # the outcome (verl's token_level_scores)
        fields += ["entropy"] if "entropy" in need else []
        fields += ["old_log_probs"] if "logprobs" in need else []
        fields += ["values"] if "values" in need else []
        fields += ["responses"] if "token_ids" in need else []
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
        mask = data["response_mask"]
        signals: Dict[str, torch.Tensor] = {}
        if "entropy" in need:
            signals["entropy"] = data["entropy"]
        if "logprobs" in need:
            signals["logprobs"] = data["old_log_probs"]
        if "values" in need:
            signals["values"] = critic_values(plan, data["values"])
        if "token_ids" in need:
            signals["token_ids"] = data["responses"]
        if "oracle_logprobs" in need:
            signals["oracle_logprobs"] = self._tc_oracle_pass(batch, mask.shape[1])
        if credit.states:
            state_metrics = step_credit_state(credit, mask, signals, rewards=data["rm_scores"].sum(-1))
            metrics.update({f"tokencredit/{k}": v for k, v in state_metrics.items()})
            self._tc_set_actor_loss()  # the loss of this step's update reads the stepped state
        est_signals = {k: v for k, v in signals.items() if k in credit.estimator.requires}
        with driver_signals(mask, est_signals):
            return self._tc_estimate(batch, metrics)

    def _tc_estimate(self, batch, metrics: dict):
        """verl's advantage step (which calls the ``tc_*`` estimator), then the estimator's own metrics
        to verl's logger (``tokencredit/gtpo/...``): verl's estimator signature returns none."""
        pop_estimator_metrics()  # nothing of an earlier call (e.g. validation) is this step's
        out = super()._compute_advantage(batch, metrics)
        metrics.update({f"tokencredit/{k}": v for k, v in pop_estimator_metrics().items()})
        self._tc_last_rollouts = self._tc_rollouts_record(out if out is not None else batch)
        return out

    def _tc_rollouts_record(self, batch) -> RolloutsRecord:
        """The step's batch as ``tokencredit inspect`` replays it (:func:`.record.rollouts_record`),
        read back from TransferQueue; written with every checkpoint (:meth:`_save_checkpoint`)."""
        import transfer_queue as tq

        keys = list(batch.keys)
        real = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)] if batch.tags else list(range(len(keys)))
        data = tq.kv_batch_get(keys=[keys[i] for i in real], partition_id=batch.partition_id, select_fields=RECORD_FIELDS)
        return rollouts_record(data, self.tokenizer, self.tokencredit_credit, int(self.global_steps))

    def _tc_oracle_pass(self, batch, width: int) -> torch.Tensor:
        """The oracle's log-probs of each response after its oracle prompt, [B, width]: the actor
        (self-oracle) through ``compute_log_prob``, or verl's distillation teacher servers."""
        import transfer_queue as tq

        oracle = self.tokencredit_plan.oracle
        keys = list(batch.keys)
        base = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["prompts", "responses", "response_mask"])
        prompts, responses = list(base["prompts"].unbind()), list(base["responses"].unbind())
        # synthetic padding samples (verl's v1 trainer) have no raw prompt; their log-probs stay 0 (mask 0)
        real = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)] if batch.tags else list(range(len(keys)))
        real_keys = [keys[i] for i in real]
        if oracle.prompt is None:
            # a teacher on the student's own prompt: verl's agent loop already scored prompt + response
            got = tq.kv_batch_get(keys=real_keys, partition_id=batch.partition_id, select_fields=["teacher_ids", "teacher_logprobs"])
            rows = [
                response_logprobs(t_ids, t_lp, len(prompts[i]), responses[i], row=i)
                for t_ids, t_lp, i in zip(got["teacher_ids"].unbind(), got["teacher_logprobs"].unbind(), real)
            ]
            return _rows_to_width(rows, real, len(keys), width)
        info = tq.kv_batch_get(keys=real_keys, partition_id=batch.partition_id, select_fields=["raw_prompt", "reward_model"])
        kw = self.config.data.get("apply_chat_template_kwargs", None) or {}
        ids = oracle_prompt_ids(self.tokencredit_plan, self.tokenizer, list(info["raw_prompt"]), list(info["reward_model"]),
                                chat_template_kwargs=dict(kw))
        if oracle.scorer == "teacher":
            rows = teacher_response_logprobs(self._tc_teacher_manager(), ids, [responses[i] for i in real])
            return _rows_to_width(rows, real, len(keys), width)
        return self._tc_actor_oracle_pass(batch, keys, real, ids, prompts, responses, base["response_mask"].unbind(), width)

    def _tc_teacher_manager(self):
        """verl's client of its distillation teacher servers (built once)."""
        if getattr(self, "_tc_teacher", None) is None:
            from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager

            self._tc_teacher = AsyncTeacherLLMServerManager(config=self.config, teacher_client=self.get_teacher_client())
        return self._tc_teacher

    def _tc_actor_oracle_pass(self, batch, keys, real, ids, prompts, responses, masks, width: int) -> torch.Tensor:
        """The actor's ``compute_log_prob`` on the oracle samples, through TransferQueue."""
        import transfer_queue as tq
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        from verl.workers.utils.padding import response_from_nested

        prompt_ids = [p.tolist() for p in prompts]  # padding rows keep their own prompt (never read)
        for j, i in enumerate(real):
            prompt_ids[i] = ids[j]
        samples = oracle_samples(prompt_ids, responses, masks)
        okeys = [f"{k}_oracle" for k in keys]
        tags = [{"seq_len": int(s["input_ids"].shape[0]), "prompt_len": int(s["prompts"].shape[0]),
                 "response_len": int(s["responses"].shape[0])} for s in samples]
        meta = tq.kv_batch_put(keys=okeys, partition_id=ORACLE_PARTITION, fields=list_of_dict_to_tensordict(samples), tags=tags)
        meta.extra_info = {**batch.extra_info, "calculate_entropy": False, "compute_loss": False,
                           "temperature": self.config.actor_rollout_ref.rollout.temperature}
        try:
            self.actor_rollout_wg.compute_log_prob(meta)
            out = tq.kv_batch_get(keys=okeys, partition_id=ORACLE_PARTITION, select_fields=["log_probs", "response_mask"])
            lp = padded(response_from_nested(out["log_probs"], out["response_mask"]))
        finally:
            tq.kv_clear(keys=okeys, partition_id=ORACLE_PARTITION)
        if lp.shape[1] < width:
            lp = torch.nn.functional.pad(lp, (0, width - lp.shape[1]))
        return lp

    # -- the critic: after the actor when the method declares so ---------------------------------

    def _tc_after_actor(self) -> bool:
        return self.tokencredit_plan.critic is not None and self.tokencredit_plan.critic.after_actor

    def _update_critic(self, batch, metrics: dict):
        if self._tc_after_actor():
            return batch  # trained in _update_actor, after the actor's update
        return super()._update_critic(batch, metrics)

    def _update_actor(self, batch, metrics: dict):
        import transfer_queue as tq
        from tensordict import TensorDict
        from verl.workers.utils.padding import response_from_nested, response_to_nested

        # ask tokencredit's actor engine for the worker signals of the update's forward (.engine),
        # for this call only: later passes on the same batch (the IS pass below) must not compute them
        request = {WORKER_SIGNAL_KEYS[s]: True for s in worker_signals(self.tokencredit_plan)}
        batch.extra_info.update(request)
        try:
            batch = super()._update_actor(batch, metrics)
        finally:
            for k in request:
                batch.extra_info.pop(k, None)
        if not self._tc_after_actor():
            return batch
        # a log-prob pass of the updated actor, then the critic on the masked per-token IS weights
        batch.extra_info.update({"calculate_entropy": False, "compute_loss": False,
                                 "temperature": self.config.actor_rollout_ref.rollout.temperature})
        self.actor_rollout_wg.compute_log_prob(batch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["log_probs", "old_log_probs", "response_mask"])
        new = padded(response_from_nested(data["log_probs"], data["response_mask"]))
        old = padded(data["old_log_probs"])
        mask = padded(data["response_mask"])
        w = self.tokencredit_plan.critic.is_weights(new, old, mask)
        m = mask.bool()
        metrics["tokencredit/critic_is_kept"] = float(((w > 0) & m).sum() / m.sum().clamp_min(1))
        # the critic reads the fields its batch metadata lists: hand it the metadata this write returns
        batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                fields=TensorDict({CRITIC_WEIGHTS_FIELD: response_to_nested(w, data["response_mask"])},
                                                  batch_size=len(batch)))
        return super()._update_critic(batch, metrics)

    # -- state in checkpoints --------------------------------------------------------------------

    def _save_checkpoint(self):
        super()._save_checkpoint()
        record = getattr(self, "_tc_last_rollouts", None)
        if record is not None:  # what `tokencredit inspect DEFAULT_LOCAL_DIR` replays
            folder = os.path.join(self.config.trainer.default_local_dir, "eval")
            os.makedirs(folder, exist_ok=True)
            record.save(os.path.join(folder, f"rollouts_step_{self.global_steps:08d}.pt"))
        if self.tokencredit_credit.states:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            save_credit_state(folder, self.tokencredit_credit)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if not self.tokencredit_credit.states or self.global_steps <= 0:
            return
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        load_credit_state(folder, self.tokencredit_credit)
