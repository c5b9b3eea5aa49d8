"""Token-level credit in TRL: ``TokenCreditGRPOTrainer``, a ``trl.GRPOTrainer`` whose advantages
come from a tokencredit credit spec.

(One module past ~600 lines on purpose: it does one job, adapting one TRL class. Its hooks share
the instance's state and the list of TRL internals they rely on (``_TRL_METHODS``), which is
checked in one place; the credit math, the signal plan and its passes already live in the core.)

Three lines change in a TRL script::

    from tokencredit.integrations.trl import TokenCreditGRPOTrainer     # was: from trl import GRPOTrainer
    trainer = TokenCreditGRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=ds,
                                     credit="grpo+taco", credit_config={"taco": {"lam": 0.5}})

How it hooks in (checked against TRL 1.16.0; the private names are checked when the trainer is
built and a missing one fails with the installed TRL version in the message):

* ``_calculate_rewards`` is wrapped: it still runs TRL's reward functions, on the rows as
  ``tokencredit train`` and the verl adapter give them (a verl-layout row's ``ground_truth`` and
  ``extra_info`` keys as columns: :func:`tokencredit.data.rewards.reward_columns`; any other row as
  TRL passes it); the returned [N, n_funcs] rewards (gathered over processes) are kept, so the
  estimator sees the raw weighted reward sum, not TRL's normalised advantage.
* ``_generate_and_score_completions`` calls TRL's, then computes the signals the spec declares
  (``CreditPipeline.required_signals``, nothing else), builds a :class:`CreditBatch` over the
  whole generation batch of every process (groups of ``num_generations`` consecutive
  completions may straddle processes, as in TRL) and replaces ``out["advantages"]`` (B,) by the
  [B, T] token advantages. TRL's ``_compute_loss`` accepts [B, T] advantages (it unsqueezes
  only 1-D ones).
* Stateful methods (STARE's controller) step once per training generation batch (one rollout
  step), from that batch, *before* its credit is computed, so the loss reads the updated state
  (the order of STARE's reference trainer); eval batches never move it. The state is written as
  ``credit_state.json`` in each checkpoint (``_save_checkpoint``) and read back on resume
  (``_load_optimizer_and_scheduler``), the pattern TRL uses for its own entropy controller.
* Method metrics and tokencredit's credit diagnostics go to TRL's logs
  (``self._metrics[mode][name]``) under their namespaced names (``taco/weight_mean``,
  ``diag/weight_gini``, ...).

Signals: the spec's methods declare them and the extra passes they need; ``tokencredit.credit.plan``
turns that into the minimal set of passes (in ``__init__``, so an unmet need fails at
construction) and ``tokencredit.engine.passes.run_passes`` runs them, as in tokencredit's own trainer,
with a TRL forward (one plain no-grad forward under TRL's autocast, ``logits_to_keep=T+1``) and
what TRL already computed passed as given: its generation-time ``old_per_token_logps`` (then the
policy pass runs only for entropy / mode probability) and, when ``beta > 0``, its reference
``ref_per_token_logps``; otherwise the reference is the adapter-off pass of a PEFT model. An
oracle pass scores the completion after the declared oracle prompt, built by
:func:`tokencredit.engine.passes.oracle_texts` from the dataset's question and answer columns and
rendered and tokenised by TRL's ``_tokenize_prompts``, or after the student's own prompt. All
signals are computed on the policy of the generation step: with TRL's default
``steps_per_generation == gradient_accumulation_steps`` and ``num_iterations == 1`` that is the
policy the update starts from.

Rollout correction (``rollout_correction={...}``, verl's ``rollout_correction`` names:
``rollout_is`` token|sequence, ``rollout_is_threshold``, ``rollout_is_batch_normalize``,
``rollout_rs``, ``rollout_rs_threshold``): :func:`tokencredit.credit.losses.rollout_correction.rollout_correction`
of the trainer's old log-probs (TRL's ``old_per_token_logps``, else the policy pass) against the
sampler's (TRL's ``sampling_per_token_logps``: vLLM's ``processed_logprobs``, i.e. of the
temperature-scaled, top-p / top-k truncated distribution the token was drawn from, or what a
``rollout_func`` returns as ``logprobs``). The TIS weight, times 0 where MIS rejects, multiplies
each token's advantage, which for every TRL loss is the same as multiplying its per-token policy
loss (each is positively homogeneous in the advantage), as TRL's own IS ratio does: a rejected
token stays in the loss's normaliser, as in TRL's ``*_mask`` modes (verl and the own trainer
drop it from the mask). The mismatch (``rollout_corr/log_ratio_mean|max|min``, ``kl``,
``rollout_rs_masked_fraction`` ...) is logged every generation whenever both log-probs exist,
with or without a correction. Without vLLM or a ``rollout_func`` TRL records no sampler's
log-probs, and TRL's own ``vllm_importance_sampling_correction`` would correct a second time:
both are refused at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from typing import Any, Dict, Optional

import torch

try:
    import trl
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tokencredit.integrations.trl needs TRL (tested with trl 1.16): pip install 'trl>=1.16,<1.17'"
    ) from e

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..credit.batch import CreditBatch
from ..credit.losses.rollout_correction import RolloutCorrectionConfig, rollout_correction
from ..credit.plan import PlanError, plan_signals
from ..train.records import RolloutsRecord
from ..credit.spec import CreditPipeline, load_credit_state, save_credit_state

__all__ = ["TokenCreditGRPOTrainer", "CREDIT_STATE_NAME", "TESTED_TRL_VERSION", "checkpointing_field", "checkpointing_args"]

#: tokencredit's policy losses that TRL's GRPOTrainer lacks (refused by name as a loss_type)
_NOT_IN_TRL = {"clip_cov": "Clip-Cov", "kl_cov": "KL-Cov"}

#: the TRL minor version this integration was written and tested against
TESTED_TRL_VERSION = "1.16"
#: file written into every checkpoint folder
CREDIT_STATE_NAME = "credit_state.json"

# Private GRPOTrainer / Trainer methods this integration overrides or calls, and why.
_TRL_METHODS = {
    "_generate_and_score_completions": "overridden: its (B,) advantages are replaced by [B, T] credit",
    "_calculate_rewards": "wrapped: the raw per-function rewards are kept for the estimator",
    "_get_per_token_logps_and_entropies": "called: policy log-probs / entropy and the reference of multimodal batches",
    "_tokenize_prompts": "called: oracle prompts are rendered and tokenised as TRL does its prompts",
    "_compute_loss": "relied on: it accepts [B, T] advantages",
    "_save_checkpoint": "overridden: writes credit_state.json into the checkpoint",
    "_load_optimizer_and_scheduler": "overridden: reads credit_state.json on resume",
    "_get_output_dir": "called: locates the checkpoint folder",
}
# Instance attributes read after GRPOTrainer.__init__.
_TRL_ATTRIBUTES = (
    "_metrics", "_logs", "reward_weights", "num_generations", "num_generations_eval", "temperature",
    "beta", "ref_model", "accelerator", "_tokenizer",
)
# Multimodal keys of TRL's generation output that its log-prob helper takes as keyword arguments.
_MM_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def _trl_problem(what: str) -> RuntimeError:
    return RuntimeError(
        f"TokenCreditGRPOTrainer: {what}. It was written against TRL {TESTED_TRL_VERSION}.x and depends on "
        f"GRPOTrainer internals; the installed TRL is {trl.__version__}. Install trl>={TESTED_TRL_VERSION},<1.17 "
        f"or use tokencredit's own trainer."
    )


def _check_trl_methods() -> None:
    for name, why in _TRL_METHODS.items():
        if not callable(getattr(GRPOTrainer, name, None)):
            raise _trl_problem(f"trl.GRPOTrainer has no method {name!r} ({why})")


# transformers 5.10 calls the activation-recomputation switch of ``TrainingArguments``
# ``gradient_checkpointing``; newer releases may call it ``activation_checkpointing``. The new
# name wins when both exist (the old one is then a deprecated alias).
_CHECKPOINTING_FIELDS = ("activation_checkpointing", "gradient_checkpointing")


def checkpointing_field(config_cls=None) -> str:
    """The name of the activation (gradient) checkpointing field of ``config_cls`` (default
    ``trl.GRPOConfig``): ``"gradient_checkpointing"`` in transformers 5.10, or
    ``"activation_checkpointing"`` where a newer transformers renamed it."""
    cls = config_cls if config_cls is not None else trl.GRPOConfig
    names = {f.name for f in dataclasses.fields(cls)}
    for name in _CHECKPOINTING_FIELDS:
        if name in names:
            return name
    raise _trl_problem(f"{cls.__name__} has none of the fields {list(_CHECKPOINTING_FIELDS)}")


def checkpointing_args(enabled: bool, config_cls=None) -> Dict[str, bool]:
    """``{field: enabled}`` for the installed transformers, e.g.
    ``GRPOConfig(**checkpointing_args(False), ...)`` turns activation checkpointing (TRL's
    default: on) off under either field name."""
    return {checkpointing_field(config_cls): bool(enabled)}


def _checkpointing_kwargs(args) -> Optional[dict]:
    for name in _CHECKPOINTING_FIELDS:
        kw = getattr(args, f"{name}_kwargs", None)
        if kw is not None:
            return kw
    return None


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _model_name(model) -> str:
    return f"model {model!r}" if isinstance(model, str) else f"a {type(model).__name__}"


def _in_trl_terms(message: str, model) -> str:
    """A plan error's one line with the own trainer's options spelled as this trainer's arguments."""
    for cli, trl_arg in (
        ("model.teacher:", "oracle_model:"),
        ("--model.teacher NAME", "oracle_model=<a frozen model with the policy's tokenizer>"),
        ("--model.lora", "peft_config=LoraConfig(...) or a peft LoRA model"),
        ("got one without", f"got {_model_name(model)} without one"),
    ):
        message = message.replace(cli, trl_arg)
    return re.sub(r"--credit-args (\w+)\.(\w+)=(\w+)", r"credit_config={'\1': {'\2': '\3'}}", message)


# -- JSON round trip of method state (tensors become tagged lists) ------------------------
class TokenCreditGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with token-level advantages from a tokencredit credit spec.

    Args (besides every ``GRPOTrainer`` argument, passed through unchanged):
        credit: a credit spec, e.g. ``"grpo"``, ``"grpo+taco"``, ``"oppo+stare"``, ``"rloo+arca"``.
        credit_config: per-method overrides by method name, e.g. ``{"taco": {"lam": 0.5}}``.
        prompt_column: dataset column holding the question that an oracle prompt is built from
            (methods that declare one: OPPO, self-oracle OPD). When it holds a conversation, its
            last user message is the question.
        answer_column: dataset column with the reference answer (the same methods).
        oracle_model: a frozen model (same tokenizer) for a method that declares a teacher-scored
            pass (OPPO / OPD with ``oracle="teacher"``); ``None``: no teacher.
        retain_memory: on a CPU with glibc, keep freed memory in the process for the next step
            (``tokencredit.engine.cpu_memory``, process-wide, as ``tokencredit train`` does): 19% off
            TRL's step in ``benchmarks/step_vs_trl.py``; numbers are unchanged.
        rollout_correction: verl's ``rollout_correction`` settings (a dict or a
            :class:`~tokencredit.credit.losses.rollout_correction.RolloutCorrectionConfig`): TIS / MIS
            against the sampler's log-probs (the module's doc); needs ``use_vllm=True`` with
            ``vllm_importance_sampling_correction=False``, or a ``rollout_func``. None: off (the
            mismatch is still logged when TRL has both log-probs).

    After each generation, ``last_credit_batch`` (the :class:`CreditBatch` of the whole generation
    batch, all processes) and ``last_credit_output`` hold what the credit was computed from.
    """

    def __init__(
        self,
        *args: Any,
        credit: str = "grpo",
        credit_config: Optional[Dict[str, Any]] = None,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        oracle_model: Optional[torch.nn.Module] = None,
        retain_memory: bool = True,
        rollout_correction: Optional[Any] = None,
        **kwargs: Any,
    ):
        import inspect

        _check_trl_methods()
        if not trl.__version__.startswith(TESTED_TRL_VERSION + "."):
            warnings.warn(
                f"TokenCreditGRPOTrainer was tested with TRL {TESTED_TRL_VERSION}.x; the installed TRL is "
                f"{trl.__version__}. The internals it needs are present, but check the credit it computes.",
                stacklevel=2,
            )
        self.credit = CreditPipeline(credit, dict(credit_config or {}))
        if "values" in self.credit.required_signals:
            methods = [m.name for m in self.credit.methods if "values" in m.requires]
            raise ValueError(
                f"credit '{self.credit.name}': method(s) {methods} need a critic's values, which TRL's "
                f"GRPOTrainer does not train. Use tokencredit's own trainer (tokencredit train --credit "
                f"{self.credit.name}) or verl for critic-based credit."
            )

        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        model = bound.get("model")
        cfg = bound.get("args")
        peft_config = bound.get("peft_config")
        uses_peft = peft_config is not None or _is_peft(model)

        if cfg is not None:
            if cfg.loss_type in _NOT_IN_TRL:
                raise ValueError(
                    f"loss_type={cfg.loss_type!r}: TRL's GRPOTrainer has no {_NOT_IN_TRL[cfg.loss_type]} loss (it would fail "
                    f"at the first loss); train it with tokencredit train --loss.policy-loss {cfg.loss_type} or verl's "
                    f"policy_loss.loss_mode={cfg.loss_type}"
                )
            scale = {True: "group", False: "none"}.get(cfg.scale_rewards, cfg.scale_rewards)
            if scale != "group":
                raise ValueError(
                    f"scale_rewards: TokenCreditGRPOTrainer replaces TRL's advantage normalisation by the credit "
                    f"spec's estimator, so scale_rewards must stay 'group' (its default); got {cfg.scale_rewards!r}. "
                    f"For no std scaling use credit='dr_grpo...' or credit_config={{'grpo': {{'std_normalize': False}}}}."
                )
            if cfg.multi_objective_aggregation != "sum_then_normalize":
                raise ValueError(
                    f"multi_objective_aggregation: expected 'sum_then_normalize' (the estimator receives the weighted "
                    f"sum of the raw rewards), got {cfg.multi_objective_aggregation!r}"
                )
        beta = cfg.beta if cfg is not None else 0.0
        self.rollout_correction = _rollout_correction_config(rollout_correction, cfg, bound.get("rollout_func"))

        # the passes the spec's methods declare (tokencredit.credit.plan): TRL's KL term reads its own
        # reference pass, so kl stays off; a reference the credit needs is TRL's (beta > 0, given)
        # or the adapter-off pass of a PEFT model
        try:
            self._plan = plan_signals(self.credit, lora=uses_peft, kl=False, teacher=oracle_model is not None)
        except PlanError as e:
            raise ValueError(_in_trl_terms(str(e), model)) from None
        if self.rollout_correction.active:  # the trainer's old log-probs, against the sampler's
            self._plan = self._plan.with_signals({"logprobs"})
        if self._plan.reference and beta == 0.0:
            raise ValueError(
                f"credit '{self.credit.name}' needs ref_logprobs: set GRPOConfig(beta=...) > 0 (TRL then keeps a "
                f"reference model) or train a PEFT adapter (the adapter-off pass is the reference); got beta=0 "
                f"and {_model_name(model)} without an adapter"
            )

        self.prompt_column = prompt_column
        self.answer_column = answer_column
        self.oracle_model = oracle_model
        if self._plan.oracle is not None and self._plan.oracle.prompt is not None:  # an oracle prompt is built
            ds = bound.get("train_dataset")
            cols = getattr(ds, "column_names", None)
            if isinstance(cols, list):
                missing = [c for c in dict.fromkeys([prompt_column, answer_column]) if c not in cols]
                if missing:
                    raise ValueError(
                        f"credit '{self.credit.name}' builds oracle prompts from dataset columns "
                        f"prompt_column={prompt_column!r} and answer_column={answer_column!r}; the train dataset "
                        f"lacks {missing} (its columns: {cols})"
                    )

        super().__init__(*args, **kwargs)
        if retain_memory and self.args.device.type == "cpu":
            from ..engine.cpu_memory import retain_freed_memory

            retain_freed_memory()

        for attr in _TRL_ATTRIBUTES:
            if not hasattr(self, attr):
                raise _trl_problem(f"GRPOTrainer instance has no attribute {attr!r}")
        if "hidden" in self._plan.adapter_off:  # a method reads the adapter's effect: it must be LoRA
            unwrapped = self.accelerator.unwrap_model(self.model)
            active = getattr(unwrapped, "active_adapter", "default")
            pcfg = getattr(unwrapped, "peft_config", {}).get(active)
            ptype = str(getattr(getattr(pcfg, "peft_type", None), "value", getattr(pcfg, "peft_type", None)))
            if ptype != "LORA":
                raise ValueError(
                    f"credit '{self.credit.name}' needs hidden_residual from a LoRA adapter; the model's active "
                    f"adapter {active!r} is of type {ptype}"
                )
        if self.oracle_model is not None:
            self.oracle_model.to(self.accelerator.device).eval().requires_grad_(False)
        self._tc_rewards_per_func: Optional[torch.Tensor] = None
        self.last_credit_batch: Optional[CreditBatch] = None
        self.last_credit_output = None
        self._tc_warned_eval = False

    # -- TRL hooks -------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # the columns as every trainer gives them (verl's layout: ground_truth, extra_info's keys;
        # tokencredit.data.rewards.reward_columns); other rows pass unchanged, as TRL passes them
        from ..data.rewards import reward_columns

        inputs = [reward_columns(x) for x in inputs]
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._tc_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._tc_rewards_per_func = None
        out = super()._generate_and_score_completions(inputs)
        if self._tc_rewards_per_func is None:
            raise _trl_problem("GRPOTrainer._generate_and_score_completions did not call _calculate_rewards")
        mode = "train" if self.model.training else "eval"
        k = self.num_generations if mode == "train" else self.num_generations_eval
        if k < 2:
            # eval with one generation per prompt: no group to compare with; TRL's (zero) advantages stay
            if not self._tc_warned_eval:
                warnings.warn(
                    f"num_generations_eval={k}: token credit needs groups of >= 2 completions; eval keeps TRL's "
                    f"advantages",
                    stacklevel=2,
                )
                self._tc_warned_eval = True
            return out
        batch, local = self._credit_batch(out, inputs, k)
        # a training generation batch is one rollout step: stateful methods (STARE's controller)
        # step once from it, before its loss, and its credit reads the updated state (the
        # reference's order); eval batches never move the state
        res = self.credit(batch, update_state=(mode == "train"))
        B, T = out["completion_ids"].shape
        lo = self.accelerator.process_index * B
        out["advantages"] = res.advantages[lo : lo + B, :T].to(out["completion_ids"].device, torch.float32)
        self._rollout_correct(out, local, mode)
        from ..credit.diagnostics import credit_diagnostics

        for name, value in {**res.metrics, **credit_diagnostics(batch, res)}.items():
            self._metrics[mode][name].append(float(value))
        self._replace_logged_advantages(res.advantages, batch.mask)
        self.last_credit_batch = batch
        self.last_credit_output = res
        if mode == "train":  # what `tokencredit inspect` replays (written with each checkpoint)
            self._tc_last_rollouts = self._rollouts_record(out, inputs, batch, res)
        return out

    def _rollouts_record(self, out, inputs, batch, res) -> RolloutsRecord:
        """The training batch in the saved-rollouts format (:class:`tokencredit.train.records.RolloutsRecord`)
        of the own trainer's ``eval/rollouts_step_*.pt``: signals, credit, tokens, texts,
        questions, method configs and state."""
        ids = self._gather_rows(out["completion_ids"], float(self._tokenizer.pad_token_id or 0)).long().cpu()
        questions = []
        for x in inputs:
            q = x.get(self.prompt_column, x.get("prompt"))
            questions.append(_last_user_text(q, 0) if isinstance(q, list) else str(q))
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            questions = gather_object(questions)
        return RolloutsRecord.build(self.credit, batch, res, response_ids=ids, tokenizer=self._tokenizer,
                                    questions=questions, step=int(self.state.global_step) + 1)  # the step that trains on it

    def save_rollouts(self, path: Optional[str] = None) -> Optional[str]:
        """Write the last training batch for ``tokencredit inspect`` (default
        ``OUTPUT_DIR/eval/rollouts_step_XXXXXXXX.pt``); done with every checkpoint. None when no
        training batch was seen yet."""
        record = getattr(self, "_tc_last_rollouts", None)
        if record is None or not self.accelerator.is_main_process:
            return None
        if path is None:
            folder = os.path.join(self.args.output_dir, "eval")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rollouts_step_{self.state.global_step:08d}.pt")
        record.save(path)
        return path

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        self.save_rollouts()
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            save_credit_state(os.path.join(folder, CREDIT_STATE_NAME), self.credit)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CREDIT_STATE_NAME)
        if not os.path.exists(path):
            if self.credit.states:
                warnings.warn(
                    f"resuming from {checkpoint}, which has no {CREDIT_STATE_NAME}: the state of "
                    f"{sorted(self.credit.states)} starts from its initial value",
                    stacklevel=2,
                )
            return
        load_credit_state(path, self.credit)

    def _rollout_correct(self, out: Dict[str, Any], local: Dict[str, torch.Tensor], mode: str) -> None:
        """The rollout correction of this process's rows (the module's doc): the mismatch metrics
        whenever the sampler's and the trainer's old log-probs both exist; with a correction on,
        the TIS weights (0 where MIS rejects) multiply the advantages."""
        behaviour = out.get("sampling_per_token_logps")
        old = out.get("old_per_token_logps")
        if old is None:
            old = local.get("logprobs")
        if behaviour is None or old is None:
            return
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        old = old.detach().float()
        # a token vLLM gave no log-prob for (NaN) gets ratio 1, as in TRL's own correction
        behaviour = torch.where(torch.isnan(behaviour), old, behaviour.float())
        weights, keep, metrics = rollout_correction(old, behaviour, mask, self.rollout_correction)
        for name, value in metrics.items():
            self._metrics[mode][name].append(float(value))
        if self.rollout_correction.active:
            factor = keep.to(out["advantages"].dtype)
            if weights is not None:
                factor = factor * weights.to(factor.dtype)
            out["advantages"] = out["advantages"] * factor

    # -- credit ----------------------------------------------------------------------------
    def _gather_rows(self, x: torch.Tensor, pad: float) -> torch.Tensor:
        """[B_local, T_local] on every process -> [B_global, T_max], padded with ``pad``."""
        if self.accelerator.num_processes == 1:
            return x
        x = self.accelerator.pad_across_processes(x, dim=1, pad_index=pad)
        return self.accelerator.gather(x)

    def _credit_batch(self, out: Dict[str, Any], inputs, group_size: int):
        device = out["completion_ids"].device
        mask = out["completion_mask"]
        if "tool_mask" in out:
            mask = mask * out["tool_mask"]
        signals = self._credit_signals(out, inputs) if self._plan.passes or self._plan.signals else {}
        # the pre-update (behaviour) log-probs: TRL's generation-time pass when it ran one, else
        # the policy pass's (AR-Lopti reads them)
        old = out.get("old_per_token_logps")
        if old is None:
            old = signals.get("logprobs")
        if old is not None:
            signals["old_logprobs"] = old.detach().float()

        rpf = self._tc_rewards_per_func.to(device)
        rewards = (rpf * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        # every reward function returned None: no outcome. TRL zeroes such a completion's advantage;
        # here its row is masked (zero credit) and its reward is the mean of its group's scored
        # completions, so that it does not move the group's baseline.
        unscorable = torch.isnan(rpf).all(dim=1)
        N = rewards.shape[0]
        if N % group_size:
            raise _trl_problem(f"{N} rewards are not a multiple of num_generations={group_size}")
        group_ids = torch.arange(N, device=device) // group_size
        if bool(unscorable.any()):
            grouped = torch.where(unscorable, torch.nan, rewards).view(-1, group_size)
            fill = torch.nan_to_num(torch.nanmean(grouped, dim=1), nan=0.0).repeat_interleave(group_size)
            rewards = torch.where(unscorable, fill, rewards)

        mask_g = self._gather_rows(mask.float(), 0.0)
        if mask_g.shape[0] != N:
            raise _trl_problem(f"gathered {mask_g.shape[0]} completions but {N} rewards")
        mask_g = mask_g * (~unscorable).unsqueeze(1).to(mask_g.dtype)
        fields = {name: self._gather_rows(v.float(), float("nan")) for name, v in signals.items()}
        batch = CreditBatch(response_mask=mask_g, rewards=rewards.float(), group_ids=group_ids, **fields)
        return batch, signals

    @torch.no_grad()
    def _credit_signals(self, out: Dict[str, Any], inputs) -> Dict[str, torch.Tensor]:
        """The plan's passes on this process's rows (:func:`tokencredit.engine.passes.run_passes`), with
        what TRL already computed passed as ``given`` (not recomputed)."""
        from ..engine.passes import PassInputs, PassModels, run_passes

        plan = self._plan
        prompt_ids, completion_ids = out["prompt_ids"], out["completion_ids"]
        P = prompt_ids.size(1)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        att = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        bs = self.args.per_device_train_batch_size if self.model.training else self.args.per_device_eval_batch_size
        given: Dict[str, torch.Tensor] = {}
        if out.get("old_per_token_logps") is not None:  # TRL's generation-time policy pass (same weights)
            given["logprobs"] = out["old_per_token_logps"]
        if out.get("ref_per_token_logps") is not None:  # beta > 0: TRL's reference pass
            given["ref_logprobs"] = out["ref_per_token_logps"]
        inp = PassInputs(input_ids=ids, attention_mask=att, prompt_len=P, response_ids=completion_ids,
                         response_mask=out["completion_mask"], decode=self._tokenizer.decode)
        if plan.oracle is not None:
            inp.oracle_input_ids, inp.oracle_attention_mask, inp.oracle_prompt_len = self._oracle_inputs(inputs, out, ids, att)
        mm = {k: out[k] for k in _MM_KEYS if k in out}
        models = PassModels(policy=self.model, reference=self.ref_model, teacher=self.oracle_model,
                            adapter_off=self._adapter_off)
        with self._no_checkpointing():
            if mm:
                given.update(self._multimodal_signals(given, ids, att, completion_ids.size(1), bs, mm))
            sig = run_passes(plan, models, inp, temperature=self.temperature, micro_batch_size=bs,
                             forward=self._signal_forward, given=given)
        return {k: v.detach().float() for k, v in sig.items() if k in plan.signals}

    def _signal_forward(self, model, ids, att, prompt_len, *, hidden=False):
        """``passes.Forward`` in TRL: one plain no-grad forward under TRL's autocast, keeping the
        logits of the T + 1 last positions; returns ``(h [N, T+1, D] | None, logits [N, T, V])``,
        row t of each being the state / distribution that predicts completion token t."""
        T = ids.size(1) - prompt_len
        extra = {"output_hidden_states": True} if hidden else {}
        with self.accelerator.autocast():
            o = model(input_ids=ids, attention_mask=att, logits_to_keep=T + 1, use_cache=False, **extra)
        return (o.hidden_states[-1][:, -T - 1 :] if hidden else None), o.logits[:, :-1]

    def _adapter_off(self):
        # The adapter-off pass gives ARCA's base states and, when beta == 0, the LoRA reference.
        # TRL keeps an initial copy of a re-trained adapter (adapter "ref") only when beta != 0,
        # and then its own reference pass gives ref_logprobs (given, never recomputed), so this
        # pass never needs "ref": disabling the adapter is TRL's use_adapter(model, None).
        return self.accelerator.unwrap_model(self.model).disable_adapter()

    def _no_checkpointing(self):
        # TRL turns gradient checkpointing off around its own no-grad passes (a warning otherwise)
        try:
            from trl.models.utils import disable_gradient_checkpointing
        except ImportError:
            return contextlib.nullcontext()
        return disable_gradient_checkpointing(self.model, _checkpointing_kwargs(self.args))

    def _multimodal_signals(self, given, ids, att, T, bs, mm) -> Dict[str, torch.Tensor]:
        """Multimodal batches: the policy's log-probs / entropy and the adapter-off reference through
        TRL's helper (which slices the image fields per chunk), returned as ``given``; the passes
        that need a plain forward (any other policy-pass signal such as mode_prob or sum_pi_squared,
        hidden states, the oracle prompt) are not supported."""
        plan = self._plan
        helper_gives = {"logprobs", "entropy"}  # what TRL's _get_per_token_logps_and_entropies returns
        own = sorted((set(plan.policy) - helper_gives) | (plan.signals & {"hidden_residual", "oracle_logprobs"}))
        if own:
            raise NotImplementedError(
                f"credit '{self.credit.name}': signals {own} need a forward pass that "
                f"TokenCreditGRPOTrainer does not implement for multimodal inputs (got {sorted(mm)})"
            )
        got: Dict[str, torch.Tensor] = {}
        policy = [s for s in plan.policy if s not in given]
        if policy:
            lp, ent, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, att, T, batch_size=bs, compute_entropy="entropy" in policy, **mm
            )
            got.update({"logprobs": lp, **({"entropy": ent} if ent is not None else {})})
        if "logprobs" in plan.adapter_off and "ref_logprobs" not in given:
            with self._adapter_off():
                got["ref_logprobs"], _, _ = self._get_per_token_logps_and_entropies(self.model, ids, att, T, batch_size=bs, **mm)
        return {k: v for k, v in got.items() if k not in given}

    def _oracle_inputs(self, inputs, out, ids, att):
        """The oracle pass's input: the declared oracle prompt (``passes.oracle_texts`` of each row's
        prompt, question and answer), rendered and tokenised by TRL's ``_tokenize_prompts``, then
        the same completions; the student's own input when the oracle sees the student's prompt."""
        from trl.trainer.utils import pad

        from ..engine.passes import oracle_texts

        if self._plan.oracle.prompt is None:  # a teacher scores the student's own prompt + completion
            return ids, att, out["prompt_ids"].size(1)
        convs, questions, answers = [], [], []
        for i, x in enumerate(inputs):
            for col in dict.fromkeys([self.prompt_column, self.answer_column, "prompt"]):
                if col not in x:
                    raise KeyError(
                        f"oracle prompt: row {i} has no column {col!r} (prompt_column={self.prompt_column!r}, "
                        f"answer_column={self.answer_column!r}); columns: {sorted(x)}"
                    )
            base, q = x["prompt"], x[self.prompt_column]
            if isinstance(base, list):
                _last_user_index(base, i)  # a text user message to replace
            convs.append(base)
            questions.append(_last_user_text(q, i) if isinstance(q, list) else q)  # a conversation: its last user message
            answers.append(x[self.answer_column])
        # conversations stay conversations: TRL renders them (chat template, tools, kwargs)
        prompts = oracle_texts(self._plan, convs, questions, answers, render=lambda conv: conv)
        oracle_ids, _, mm = self._tokenize_prompts(prompts)
        if mm:
            raise NotImplementedError(f"oracle prompts with multimodal fields {sorted(mm)} are not supported")
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        device = completion_ids.device
        rows = [torch.as_tensor(r, dtype=torch.long) for r in oracle_ids]
        pid = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        pmask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        o_ids = torch.cat([pid, completion_ids], dim=1)
        o_att = torch.cat([pmask, completion_mask.to(pmask.dtype)], dim=1)
        return o_ids, o_att, pid.size(1)

    def _replace_logged_advantages(self, advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """TRL logs one advantage per completion (completions table): log the row's mean credit."""
        log = getattr(self, "_logs", {}).get("advantages")
        n = advantages.shape[0]
        if log is None or not hasattr(log, "pop") or len(log) < n:
            return
        for _ in range(n):
            log.pop()
        m = mask.to(advantages.dtype)
        log.extend(((advantages * m).sum(1) / m.sum(1).clamp_min(1.0)).tolist())


def _rollout_correction_config(value, args, rollout_func) -> RolloutCorrectionConfig:
    """``rollout_correction`` as a config, checked against TRL's settings before any model loads:
    one line naming the field, the expected and the actual value."""
    if value is None or isinstance(value, RolloutCorrectionConfig):
        rc = value if value is not None else RolloutCorrectionConfig()
    elif isinstance(value, dict):
        names = [f.name for f in dataclasses.fields(RolloutCorrectionConfig)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"rollout_correction: expected settings among {names}, got unknown {unknown}")
        try:
            rc = RolloutCorrectionConfig(**value)
        except ValueError as e:
            raise ValueError(str(e).replace("loss.", "rollout_correction.")) from None
    else:
        raise ValueError(f"rollout_correction: expected None, a dict of verl's rollout_correction settings or a "
                         f"RolloutCorrectionConfig, got {type(value).__name__}")
    if not rc.active:
        return rc
    use_vllm = bool(getattr(args, "use_vllm", False))
    if not use_vllm and rollout_func is None:
        raise ValueError(
            "rollout_correction: needs the sampler's log-probs, which TRL records only with vLLM or a rollout_func: "
            "expected GRPOConfig(use_vllm=True) or a rollout_func returning logprobs, got use_vllm=False and no rollout_func"
        )
    if use_vllm and getattr(args, "vllm_importance_sampling_correction", False):
        raise ValueError(
            "vllm_importance_sampling_correction: expected False with rollout_correction (TRL's own correction would "
            "weigh the loss a second time), got True"
        )
    return rc


def _last_user_index(messages, row: int) -> int:
    for j in range(len(messages) - 1, -1, -1):
        if isinstance(messages[j], dict) and messages[j].get("role") == "user":
            if not isinstance(messages[j].get("content"), str):
                raise NotImplementedError(
                    f"oracle prompt: row {row}'s last user message has non-text content; only text prompts are supported"
                )
            return j
    raise ValueError(f"oracle prompt: row {row}'s prompt conversation has no user message")


def _last_user_text(messages, row: int) -> str:
    return messages[_last_user_index(messages, row)]["content"]
