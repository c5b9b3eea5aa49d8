"""tokencredit's own trainer: one process, CPU or one GPU, read top to bottom.

One step (``Trainer.train_step``), in the order it runs:

    1. collect   K samples per prompt (HF generate), rewards (guarded user code), DAPO's
                 dynamic sampling; the kept groups become one typed ``StepBatch``
    2. signals   the passes the credit spec's methods declare (``plan.plan_signals``, run by
                 ``passes.run_passes``): policy, adapter-off, reference, oracle, critic values
    3. credit    ``CreditPipeline``: stateful methods step first (STARE's order), then credit
    4. policy    the PPO / SAPO loss over micro-batches, one optimizer step per epoch
    5. critic    the declared critic's loss (PACT: after the actor, on the updated actor's pass,
                 importance-weighted)
    6. log       metrics.jsonl (+ TensorBoard / W&B), periodic eval, atomic checkpoints

The trainer knows passes, never method names: what a method needs is declared with the method
(``registry.MethodInfo``), so a method registered outside the package trains unchanged. A plain
GRPO run does no forward pass beyond the one its loss needs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import signal
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .batch import CreditBatch
from .checkpoint import check_output_dir, latest_checkpoint, load_latest_checkpoint, rng_state, save_checkpoint, set_rng_state
from .runfolder import MetricsWriter, check_run_folder, claim_run_folder, write_atomic
from .config import SAFE_TO_CHANGE, ConfigError, TrainConfig, config_diff, config_to_dict
from .batch import SIGNALS
from .forward import forward_response
from .plan import PlanError, SignalPlan, plan_signals
from .rollout import StepBatch
from .spec import CreditPipeline

__all__ = ["Trainer", "NonFiniteError", "forward_response"]


class NonFiniteError(FloatingPointError):
    """A NaN/inf appeared in training; the message names the step and the tensor."""


# ---------------------------------------------------------------------------------------
# forward passes over prompt + response


def _decoder_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def _check_finite(x: torch.Tensor, what: str, step: int, mask: Optional[torch.Tensor] = None) -> None:
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.reshape(mask.shape + (1,) * (x.dim() - mask.dim())).bool()
    if bad.any():
        raise NonFiniteError(
            f"step {step}: non-finite values in {what} (first at index {tuple(int(i) for i in bad.nonzero()[0])}); "
            f"the run stops here and the last good checkpoint is left untouched"
        )


# ---------------------------------------------------------------------------------------


class Trainer:
    """Build with a :class:`TrainConfig`; ``model``/``tokenizer``/``task`` may be injected (tests)."""

    def __init__(self, cfg: TrainConfig, *, model=None, tokenizer=None, task=None, reference=None, teacher=None):
        from .rollout import HFRollout
        from .tasks import make_task

        self.cfg = cfg
        # everything that needs no model comes first, so that a bad setting, data file, reward
        # function or run directory fails at once, before a model is loaded
        cfg.validate()
        from .precision import resolve_precision

        if cfg.precision == "auto":  # recorded resolved: config.json says what the run trained in
            cfg = self.cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, cfg.device))
        check_output_dir(cfg.output_dir)
        self.out = Path(cfg.output_dir)
        # a run folder belongs to one run: a fresh run where one is, or a folder another live
        # run holds, is refused here (runfolder.claim_run_folder takes the lock in train())
        check_run_folder(self.out, resume=cfg.resume, overwrite=cfg.overwrite)
        self._owns_run = False
        if cfg.resume:
            self._check_resume_config(self.out / "config.json")
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        )
        self.credit = CreditPipeline(cfg.credit, cfg.method_configs())  # credit_config + credit_args
        # what the spec's methods declare (signals, passes, critic, an adapter, a teacher),
        # checked against this setting before any model is loaded
        self.plan = _plan(self.credit, cfg, model=model, reference=reference, teacher=teacher)

        from .losses import get_policy_loss

        self.policy_loss = get_policy_loss(cfg.loss.policy_loss)
        try:
            self.policy_loss_cfg = _policy_loss_config(self.policy_loss, cfg.loss, self.credit, cfg.rollout.max_new_tokens)
        except ValueError as e:  # a loss setting this policy loss cannot take
            raise ConfigError(" ".join(str(e).split())) from None

        if task is None and cfg.data.path is not None:  # own data (--data.path), through `datasets`
            from .tasks import make_data_task

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
        # call runs in a killable worker process (tokencredit.rewards)
        from .rewards import runner_for

        self.rewards = runner_for(cfg, self.task)
        for flag, module, extra in (("log.tensorboard", "tensorboard", "tensorboard"), ("log.wandb", "wandb", "wandb")):
            import importlib.util

            if getattr(cfg.log, flag.split(".")[1]) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"{flag}: needs the {module} package, which is not installed: pip install 'tokencredit[{extra}]'")

        # -- models ---------------------------------------------------------------------
        from .models import ValueHead, add_lora, check_chat_template, check_generation_budget, is_lora, load_frozen, resolve_model

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
            hidden_size = _decoder_and_head(self.model)[1].weight.shape[1]
            self.critic = ValueHead(hidden_size).to(self.device)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)

        params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        fused = o.fused_adamw and self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, **({"fused": True} if fused else {})
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(o.schedule, o.warmup_steps, cfg.steps))

        from .precision import dtype_of

        # bf16: generation on a bf16 copy of the weights (re-synced after each optimizer step)
        self.rollout = HFRollout(self.model, self.tokenizer, dtype=dtype_of(cfg.precision),
                                 max_batch_size=cfg.rollout.max_batch_size)

        # -- run state ------------------------------------------------------------------
        self.step = 0
        self.epoch = 0
        self.offset = 0
        self._resumed = False  # the checkpoint of cfg.resume is loaded once (a second train() goes on)
        self.stopped_by: Optional[str] = None
        self._order = self._permutation(0)
        self._writers: List[Any] = []

    # -- data -----------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.cfg.seed * 1000 + epoch).permutation(len(self.task.train))

    def _next_examples(self, n: int):
        self._dirty = True  # the first change a step makes to the run's state
        out = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            out.append(self.task.train[int(self._order[self.offset])])
            self.offset += 1
        return out

    # -- rollout + reward ------------------------------------------------------------------
    def _generate(self, examples, *, num_samples: int, temperature: float, seed: Optional[int] = None):
        from .rollout import NonFiniteLogitsError

        r = self.cfg.rollout
        try:
            return self._generate_unchecked(examples, num_samples=num_samples, temperature=temperature, seed=seed)
        except NonFiniteLogitsError as e:
            raise NonFiniteError(
                f"step {self.step + 1}: {e}; the run stops here and the last good checkpoint is left untouched"
            ) from e

    def _generate_unchecked(self, examples, *, num_samples: int, temperature: float, seed: Optional[int]):
        r = self.cfg.rollout
        return self.rollout.generate(
            [list(e.messages) for e in examples],
            num_samples=num_samples,
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p,
            # training: the global torch RNG drives sampling (it is checkpointed); eval passes a
            # private seed so that evaluating never changes the training trajectory
            seed=seed,
        )

    def _reward_scores(self, rb, examples):
        """The reward functions on a rollout batch (tokencredit.rewards: TRL's arguments, each call
        in the killable worker, on its own copy of the rows)."""
        exs = [examples[int(i)] for i in rb.prompt_index]
        conv = bool(exs) and exs[0].conversational
        completions = [[{"role": "assistant", "content": t}] for t in rb.texts] if conv else list(rb.texts)
        ids = [row[m.bool()].tolist() for row, m in zip(rb.response_ids.cpu(), rb.response_mask.cpu())]
        prompts = [list(e.messages) if e.conversational else e.prompt_value() for e in exs]
        return self.rewards.score(completions, ids, exs, prompts, state={"global_step": self.step, "max_steps": self.cfg.steps})

    def _score(self, rb, examples) -> Dict[str, Any]:
        sc = self._reward_scores(rb, examples)
        rewards, failed = sc.total, sc.failed
        rewards = torch.tensor(rewards, dtype=torch.float32)
        correct = rewards.clone()
        if self.cfg.dapo.overlong_shaping:
            from .losses import overlong_penalty

            lengths = rb.response_mask.sum(1)
            L = self.cfg.rollout.max_new_tokens
            cache = self.cfg.dapo.overlong_cache if self.cfg.dapo.overlong_cache is not None else max(1, L // 5)
            rewards = rewards + overlong_penalty(lengths, L, cache)
        return {"rewards": rewards, "correct": correct, "failed": failed, "scores": sc}

    def _collect(self) -> Dict[str, Any]:
        """Rollouts for one step; with DAPO dynamic sampling, regenerate (bounded) to fill."""
        r, d = self.cfg.rollout, self.cfg.dapo
        kept: List[Dict[str, Any]] = []
        n_groups, rounds, failed = 0, 0, {"error": 0, "timeout": 0}
        all_rewards = []
        while True:
            rounds += 1
            examples = self._next_examples(r.prompts_per_step)
            rb = self._generate(examples, num_samples=r.samples_per_prompt, temperature=r.temperature)
            sc = self._score(rb, examples)
            all_rewards.append(sc["correct"])
            for k in failed:
                failed[k] += sc["failed"][k]
            keep = torch.ones(len(rb.texts), dtype=torch.bool)
            if d.dynamic_sampling:
                from .losses import dynamic_sampling_filter

                # on accuracy, not the overlong-shaped reward (DAPO; verl's filter_groups.metric=acc)
                keep = dynamic_sampling_filter(sc["correct"], rb.prompt_index)
                # DAPO fills the batch to its size and no further: groups past prompts_per_step
                # are dropped, so every step trains on the same number of groups as the others
                for g in rb.prompt_index[keep].unique().tolist():
                    if n_groups >= r.prompts_per_step:
                        keep &= rb.prompt_index != g
                    else:
                        n_groups += 1
            else:
                n_groups += len(examples)
            kept.append({"rb": rb, "examples": examples, "keep": keep, **sc})
            if not d.dynamic_sampling or n_groups >= r.prompts_per_step or rounds >= d.max_rounds:
                break
        # a reward function that failed on every completion of reward.max_failing_steps steps in a
        # row stops the run here (RewardFailure, one line naming it, the row and the exception)
        self.rewards.end_step(self.step + 1, [p["scores"] for p in kept])
        return {"parts": kept, "rounds": rounds, "failed": failed, "all_correct": torch.cat(all_rewards)}

    # -- signals ---------------------------------------------------------------------------
    def _temperature(self) -> float:
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    def _signals(self, batch: StepBatch, plan: SignalPlan) -> Dict[str, torch.Tensor]:
        """The plan's passes on the batch (passes.run_passes), in micro-batches, without grad."""
        from .passes import PassInputs, PassModels, run_passes

        if plan.oracle is not None and plan.oracle.prompt is not None and batch.oracle_input_ids is None:
            self._attach_oracle_inputs(batch, plan)
        inp = PassInputs(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, prompt_len=batch.prompt_len,
            response_ids=batch.response_ids, response_mask=batch.response_mask,
            # the oracle's own prompt when it has one, else the student's (a teacher on the batch)
            oracle_input_ids=batch.oracle_input_ids if batch.oracle_input_ids is not None else batch.input_ids,
            oracle_attention_mask=batch.oracle_attention_mask if batch.oracle_input_ids is not None else batch.attention_mask,
            oracle_prompt_len=batch.oracle_prompt_len if batch.oracle_input_ids is not None else batch.prompt_len,
        )
        models = PassModels(policy=self.model, reference=self.reference, teacher=self.teacher, critic=self.critic)
        with self._autocast():
            out = run_passes(plan, models, inp, temperature=self._temperature(), micro_batch_size=self.cfg.optim.micro_batch_size,
                             check=lambda x, what, m: _check_finite(x, what, self.step + 1, m))
        # (bf16: the signals leave the passes in fp32, as the rest of the step computes)
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def _autocast(self):
        """bf16 autocast under ``precision=bf16``, nothing under fp32 (tokencredit.precision)."""
        from .precision import autocast

        return autocast(self.cfg.precision, self.device.type)

    def _attach_oracle_inputs(self, batch: StepBatch, plan: SignalPlan) -> None:
        """The oracle-prompted inputs of the batch: each row's conversation with the question
        replaced by the declared oracle prompt (question + reference answer), then its response."""
        from .passes import join_prompts_and_responses, oracle_texts

        exs = [batch.examples[int(i)] for i in batch.prompt_index.tolist()]
        render = lambda msgs: self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # noqa: E731
        texts = oracle_texts(plan, [list(e.messages) for e in exs], [e.question for e in exs], [e.answer for e in exs], render)
        j = join_prompts_and_responses(self.tokenizer, texts, batch.response_ids.cpu(), batch.response_mask.cpu())
        batch.oracle_input_ids = j["input_ids"].to(self.device)
        batch.oracle_attention_mask = j["attention_mask"].to(self.device)
        batch.oracle_prompt_len = j["prompt_len"]

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

    # -- one step --------------------------------------------------------------------------
    def train_step(self) -> Dict[str, float]:
        """One step, in the order it runs: collect, signals, credit, policy update, critic update."""
        from .diagnostics import credit_diagnostics

        cfg = self.cfg
        t0 = time.perf_counter()
        # 1. collect: K samples per prompt, rewards (DAPO: regenerate to fill, bounded)
        col = self._collect()
        batch = StepBatch.assemble(col["parts"], self.tokenizer.pad_token_id)
        t_roll = time.perf_counter() - t0
        metrics: Dict[str, float] = {
            "step": float(self.step + 1),
            "reward/mean": float(col["all_correct"].mean()),
            "reward/failed_error": float(col["failed"]["error"]),
            "reward/failed_timeout": float(col["failed"]["timeout"]),
            "rollout/rounds": float(col["rounds"]),
        }
        # TRL's names: rewards/NAME/mean|std, reward, reward_std, frac_reward_zero_std, completions/*
        from .reward_metrics import completion_metrics, reward_metrics

        parts = col["parts"]
        metrics.update(reward_metrics([p["scores"] for p in parts], [p["rb"].prompt_index.tolist() for p in parts]))
        metrics.update(completion_metrics(torch.cat([p["rb"].response_mask.sum(1) for p in parts]).tolist(),
                                          torch.cat([p["rb"].truncated for p in parts]).tolist()))
        self._warn_clipped(metrics)
        if batch is None:  # dynamic sampling found no group with signal
            metrics["update/skipped"] = 1.0
            return metrics
        batch = batch.to(self.device)
        mask = batch.response_mask.bool()
        metrics.update({
            "response/len_mean": float(mask.sum(1).float().mean()),
            "response/truncated_frac": float(batch.truncated.float().mean()),
            "reward/shaped_mean": float(batch.rewards.mean()),
            "groups/count": float(len(batch) // cfg.rollout.samples_per_prompt),
        })

        # 2. signals: the plan's passes (a step whose batch is saved for `inspect` computes every
        # signal the trainer can give, so that any method can be replayed on it)
        plan = self._inspect_plan() if self._saves_rollouts_this_step() else self.plan
        # one epoch: the update's own forward gives the policy pass's signals (passes.update_gives)
        from .passes import update_gives

        fused = update_gives(plan, cfg.optim.ppo_epochs) if cfg.optim.one_pass else ()
        if fused:
            plan = dataclasses.replace(plan, policy=())
        sig = self._signals(batch, plan) if plan.passes else {}
        pre = None
        if fused:
            pre = self._policy_forwards(batch, ("logprobs", "entropy") + tuple(k for k in fused if k not in ("logprobs", "entropy")))
            sig.update({k: torch.cat([f[k].detach() for f in pre]) for k in fused})
        old_logprobs = sig.get("logprobs", batch.behaviour_logprobs)

        # 3. credit: stateful methods step their controller from this pre-update batch first and
        # the credit reads the updated state (STARE's reference order); that state is kept for
        # the saved rollouts so that a replay computes the same credit
        cb = CreditBatch(
            response_mask=batch.response_mask, rewards=batch.rewards, group_ids=batch.prompt_index,
            logprobs=old_logprobs, old_logprobs=batch.behaviour_logprobs,
            **{k: sig[k] for k in SIGNALS if k in sig and k not in ("logprobs", "old_logprobs")},
        )
        credit = self.credit(cb)
        credit_state = copy.deepcopy(self.credit.state_dict())
        metrics.update(credit.metrics)
        metrics.update(credit_diagnostics(cb, credit))

        # 4. policy update
        metrics.update(self._update_policy(batch, credit.advantages, old_logprobs, sig.get("ref_logprobs"), pre=pre))

        # 5. critic update, after the actor (PACT's order; the declared critic says whether it
        # trains on the updated actor's pass)
        if self.critic is not None:
            metrics.update(self._update_critic(batch, sig, credit, old_logprobs))

        # 6. log
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        dt = time.perf_counter() - t0
        metrics["time/step_s"] = dt
        metrics["time/rollout_s"] = t_roll
        metrics["time/tokens_per_s"] = float(mask.sum()) / max(dt, 1e-9)
        self._last_batch = {"batch": batch, "credit_batch": cb, "credit": credit, "credit_state": credit_state}
        return metrics

    def _policy_forward(self, batch, sl: slice, want) -> Dict[str, torch.Tensor]:
        """The update's forward of micro-batch ``sl`` (with grad): token signals ``want``."""
        from .signals import token_signals

        with self._autocast():
            _, logits = forward_response(self.model, batch.input_ids[sl], batch.attention_mask[sl], batch.prompt_len)
        _check_finite(logits, "policy logits", self.step + 1, batch.response_mask[sl])
        return token_signals(logits, batch.response_ids[sl], temperature=self._temperature(), want=want)

    def _policy_forwards(self, batch, want) -> List[Dict[str, torch.Tensor]]:
        """Every micro-batch's update forward, kept (with their graphs) for the update that the
        credit computed from their detached signals will drive (``optim.one_pass``)."""
        mb = self.cfg.optim.micro_batch_size
        return [self._policy_forward(batch, slice(s, s + mb), want) for s in range(0, len(batch), mb)]

    def _update_policy(self, batch, adv, old_logprobs, ref_logprobs, pre=None) -> Dict[str, float]:
        from .losses import kl_penalty, aggregate

        cfg = self.cfg
        N, T = batch.response_ids.shape
        P = batch.prompt_len
        mask = batch.response_mask
        mb = cfg.optim.micro_batch_size
        total_tokens = float(mask.sum())
        agg_mode = self.policy_loss_cfg.agg_mode
        norm_constant = getattr(self.policy_loss_cfg, "norm_constant", None)
        seq_mode = agg_mode.startswith("seq-")
        n_rows = float((mask.sum(1) > 0).sum())
        sums: Dict[str, float] = {}
        ent_sum = 0.0
        grad_norm = 0.0
        for epoch in range(cfg.optim.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for s in range(0, N, mb):
                sl = slice(s, s + mb)
                m = mask[sl]
                if m.sum() == 0:
                    continue
                # the first epoch's entropy (logged) comes out of the same pass over the logits; with
                # optim.one_pass its forward already ran (pre), before the credit
                want = ("logprobs", "entropy") if epoch == 0 else ("logprobs",)
                sig = pre[s // mb] if pre is not None and epoch == 0 else self._policy_forward(batch, sl, want)
                lp = sig["logprobs"]
                loss, lm = self.policy_loss(lp, old_logprobs[sl], adv[sl], m, self.policy_loss_cfg)
                if cfg.loss.kl_coef > 0:
                    kl = aggregate(kl_penalty(lp, ref_logprobs[sl], cfg.loss.kl_estimator), m, agg_mode, norm_constant=norm_constant)
                    loss = loss + cfg.loss.kl_coef * kl
                    lm = {**lm, "kl": float(kl.detach())}
                _check_finite(loss.detach(), "policy loss", self.step + 1)
                # each micro-batch's loss is aggregated on its own; this weight makes their sum the
                # whole batch's loss (token-sum is already additive)
                if agg_mode == "token-sum":
                    scale = 1.0
                elif seq_mode:
                    scale = float((m.sum(1) > 0).sum()) / n_rows
                else:
                    scale = float(m.sum()) / total_tokens
                (loss * scale).backward()
                for k, v in lm.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * scale / cfg.optim.ppo_epochs
                sums["policy"] = sums.get("policy", 0.0) + float(loss.detach()) * scale / cfg.optim.ppo_epochs
                if epoch == 0:
                    ent_sum += float((sig["entropy"].detach() * m).sum())
            params = [p for p in self.model.parameters() if p.requires_grad]
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
            if not torch.isfinite(gn):
                raise NonFiniteError(
                    f"step {self.step + 1}: non-finite gradient norm ({float(gn)}) in the policy update; "
                    f"the run stops here and the last good checkpoint is left untouched"
                )
            grad_norm = float(gn)
            self.optimizer.step()
            self.rollout.weights_changed()  # (a bf16 generation copy re-syncs before it next samples)
        self.scheduler.step()
        out = {f"loss/{k}": v for k, v in sums.items()}
        out["grad_norm"] = grad_norm
        out["entropy/mean"] = ent_sum / max(total_tokens, 1.0)
        return out

    def _update_critic(self, batch: StepBatch, sig, credit, old_logprobs) -> Dict[str, float]:
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
            weights = spec.is_weights(new["logprobs"], old_logprobs, mask)
            valid = mask.bool()
            out["critic/is_kept_frac"] = float(((weights > 0) & valid).sum() / valid.sum().clamp_min(1))
            out["critic/is_ratio_mean"] = float(torch.exp(new["logprobs"] - old_logprobs)[valid].mean()) if valid.any() else 1.0
        else:
            hidden = sig["hidden"].detach()
        for _ in range(self.cfg.critic.steps):
            self.critic_opt.zero_grad(set_to_none=True)
            head_out = self.critic(hidden[:, :-1]).squeeze(-1)
            loss = spec.loss(head_out, rewards=batch.rewards, returns=credit.returns, mask=mask, weights=weights)
            _check_finite(loss.detach(), "critic loss", self.step + 1)
            loss.backward()
            self.critic_opt.step()
        out["critic/loss"] = float(loss.detach())
        return out

    # -- eval -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Greedy accuracy (the mean reward of greedy completions) and mean@k on the eval split.
        Rewards go through the same guarded calls as in training (tokencredit.rewards: a killable
        worker, ``task.reward_timeout_s`` per completion); a failed value is left out (0 when it was
        the only one) and counted in ``eval/failed_error`` / ``eval/failed_timeout``. With several
        reward functions, each one's ``eval/rewards/NAME/mean`` and ``/std`` too."""
        from .reward_metrics import reward_metrics

        ex = self.task.eval
        if not ex:  # never report an accuracy of an empty split
            raise ConfigError("task: expected a non-empty eval split to evaluate, got 0 examples")
        k = self.cfg.log.eval_samples
        greedy, meank, samples = [], [], []
        failed = {"error": 0, "timeout": 0}
        greedy_scores, greedy_groups = [], []

        def score(rb, examples):
            sc = self._reward_scores(rb, examples)
            for kind in failed:
                failed[kind] += sc.failed[kind]
            return sc

        chunk = max(16, self.cfg.rollout.max_batch_size)  # prompts per greedy call (the rollout caps each call's rows)
        for s in range(0, len(ex), chunk):
            part = ex[s : s + chunk]
            rb = self._generate(part, num_samples=1, temperature=0.0)
            sc = score(rb, part)
            greedy_scores.append(sc)
            greedy_groups.append(rb.prompt_index.tolist())
            for i, text in enumerate(rb.texts):
                greedy.append(sc.total[i])
                samples.append({"id": part[i].id, "question": part[i].question, "answer": part[i].answer, "greedy": text, "reward": greedy[-1]})
            if k > 0:
                rbk = self._generate(part, num_samples=k, temperature=self.cfg.rollout.temperature,
                                     seed=self.cfg.seed * 1_000_003 + self.step * 1009 + s)
                meank.extend(score(rbk, part).total)
        # greedy_acc: the mean (weighted) reward of the greedy completions, an accuracy for a 0/1 reward
        metrics = {"eval/greedy_acc": float(np.mean(greedy))}
        if len(self.rewards.funcs) > 1:
            metrics.update({k: v for k, v in reward_metrics(greedy_scores, greedy_groups, prefix="eval/").items()
                            if k.startswith("eval/rewards/")})
        if meank:
            metrics[f"eval/mean@{k}"] = float(np.mean(meank))
        metrics["eval/failed_error"] = float(failed["error"])
        metrics["eval/failed_timeout"] = float(failed["timeout"])
        d = self.out / "eval"
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"samples_step_{self.step:08d}.jsonl", "w") as f:
            for row in samples:
                f.write(json.dumps(row) + "\n")
        if self.cfg.log.save_rollouts and getattr(self, "_last_batch", None) is not None:
            self._save_rollouts(d / f"rollouts_step_{self.step:08d}.pt")
        return metrics

    def _save_rollouts(self, path: Path) -> None:
        """The last training batch with every signal we can compute, for later inspection."""
        lb = self._last_batch
        batch, cb, credit = lb["batch"], lb["credit_batch"], lb["credit"]
        fields = {k: v for k, v in cb.to_dict().items() if v is not None}
        ids = batch.response_ids
        tokens = [[self.tokenizer.decode([int(t)]) for t, m in zip(row, mrow) if m] for row, mrow in zip(ids, batch.response_mask)]
        torch.save({
            "credit": self.credit.name,
            # the run's method settings and state (STARE's controller, ...), so that a replay of
            # this batch computes the credit the run computed
            "credit_configs": {k: dataclasses.asdict(c) for k, c in self.credit.configs.items()},
            "credit_state": lb["credit_state"],
            "step": self.step,
            "signals": fields,
            "advantages": credit.advantages,
            "token_weights": credit.token_weights,
            "response_ids": ids,
            "tokens": tokens,
            "texts": batch.texts,
            "questions": [batch.examples[int(i)].question for i in batch.prompt_index],
        }, path)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        trainable = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return {
            "step": self.step,
            "epoch": self.epoch,
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
        params = dict(self.model.named_parameters())
        missing = sorted(n for n, p in params.items() if p.requires_grad and n not in sd["model"])
        extra = sorted(n for n in sd["model"] if n not in params)
        if missing or extra:
            raise KeyError(f"checkpoint model weights: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for n, v in sd["model"].items():
                params[n].copy_(v)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.credit.load_state_dict(sd["credit"])
        if self.critic is not None:
            self.critic.load_state_dict(sd["critic"])
            self.critic_opt.load_state_dict(sd["critic_opt"])
        self.rollout.weights_changed()
        self.step, self.epoch, self.offset = sd["step"], sd["epoch"], sd["offset"]
        self._order = self._permutation(self.epoch)
        set_rng_state(sd["rng"])

    def save(self) -> Path:
        return save_checkpoint(self.out / "checkpoints", self.step, self.state_dict(), keep_last=self.cfg.keep_last)

    # -- the loop ---------------------------------------------------------------------------
    def _log(self, metrics: Dict[str, float]) -> None:
        self._metrics_file.write(metrics)  # a whole line, fsynced (runfolder.MetricsWriter)
        for w in self._writers:
            w(metrics, self.step)

    def _open_logs(self, resume_step: Optional[int] = None) -> None:
        """config.json, and metrics.jsonl opened for whole-line appends: a torn last line is
        cut off, and on resume (``resume_step``) the rows past the checkpoint are dropped."""
        self.out.mkdir(parents=True, exist_ok=True)
        write_atomic(self.out / "config.json", json.dumps(config_to_dict(self.cfg), indent=2), "config.json")
        self._metrics_file = MetricsWriter(self.out / "metrics.jsonl", resume_step=resume_step)
        if self.cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(self.out / "tensorboard"))
            self._writers.append(lambda m, s: [tb.add_scalar(k, v, s) for k, v in m.items()])
        if self.cfg.log.wandb:
            import wandb

            wandb.init(project=self.cfg.log.wandb_project, config=config_to_dict(self.cfg), dir=str(self.out))
            self._writers.append(lambda m, s: wandb.log(m, step=s))

    def train(self) -> Dict[str, float]:
        """Train to ``cfg.steps``, holding the run folder's lock (runfolder.claim_run_folder)
        for the whole run. A second ``train()`` of the same trainer continues its own run."""
        from .runfolder import DiskFullError

        lock = claim_run_folder(self.out, resume=self.cfg.resume or self._owns_run, overwrite=self.cfg.overwrite)
        self._owns_run = True
        try:
            return self._train()
        except DiskFullError as e:
            last = latest_checkpoint(self.out / "checkpoints")
            e.message += (f"; the run stopped at step {self.step}; "
                          + (f"the last checkpoint ({last}) is intact: free space and continue with --resume" if last
                             else "no checkpoint yet: free space and start again with --overwrite"))
            raise
        finally:
            lock.release()

    def _train(self) -> Dict[str, float]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        self.stopped_by: Optional[str] = None  # "SIGINT" / "SIGTERM" when a signal ended the run early
        resume_step = None
        if cfg.resume and not self._resumed:
            # the newest intact checkpoint (a damaged one is skipped with a warning), refused if
            # it was trained with other settings than these
            ck, sd = load_latest_checkpoint(self.out / "checkpoints")
            self._check_resume_config(sd.get("config"), where=ck / "state.pt")
            self.load_state_dict(sd)
            self._resumed, resume_step = True, self.step
            print(f"resumed from {ck} at step {self.step}")
        self._open_logs(resume_step)
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.log.progress, desc=f"train {self.credit.name}")
        last: Dict[str, float] = {}
        # Ctrl-C: the first one lets the running step finish, then a checkpoint is written and the
        # run stops; a second one (or one between steps) stops at once. A step that was cut off
        # half-way has already changed the data position, RNG and maybe the weights, so it is
        # never checkpointed: the last good checkpoint stays as it is. SIGTERM (schedulers,
        # `timeout`, container stops) is handled the same way.
        self._dirty, self._stop_requested = False, False
        prev_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                prev_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            if self.step == 0 and cfg.log.eval_at_start and not cfg.resume:
                self._log({"step": 0.0, **self.evaluate()})
            while self.step < cfg.steps:
                metrics = self.train_step()
                self.step += 1
                if self.step % cfg.log.eval_every == 0 or self.step == cfg.steps:
                    metrics.update(self.evaluate())
                self._log(metrics)
                last = metrics
                bar.update(1)
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.2f}",
                    entropy=f"{metrics.get('entropy/mean', float('nan')):.3f}",
                    tok_s=f"{metrics.get('time/tokens_per_s', 0):.0f}",
                    acc=f"{metrics.get('eval/greedy_acc', float('nan')):.2f}",
                    **({"clipped": f"{metrics['completions/clipped_ratio']:.2f}!"}
                       if metrics.get("completions/clipped_ratio", 0.0) > cfg.reward.clipped_warn_ratio else {}),
                )
                self._dirty = False
                if self.step % cfg.save_every == 0 or self.step == cfg.steps or self._stop_requested:
                    path = self.save()
                if self._stop_requested:
                    print(f"\nstopped after step {self.step}: checkpoint written to {path}; continue with --resume")
                    break
        except KeyboardInterrupt:
            if self._dirty:
                last_ck = latest_checkpoint(self.out / "checkpoints")
                print(f"\ninterrupted during step {self.step + 1}: not checkpointed (half-done); "
                      f"the last checkpoint ({last_ck}) is untouched; continue with --resume")
            else:
                path = self.save()
                print(f"\ninterrupted at step {self.step}: checkpoint written to {path}; continue with --resume")
        finally:
            for sig, handler in prev_handlers.items():
                signal.signal(sig, handler)
            bar.close()
            self._metrics_file.close()
            self.rewards.close()  # the reward worker process (a later call starts a new one)
        return last

    def _check_resume_config(self, saved: Any, where: Optional[Path] = None) -> None:
        """Refuse to resume a run whose training-relevant settings differ from this config's.

        ``saved`` is the run's config (a dict, or the path of its ``config.json``; a missing file
        is no objection: the checkpoint's own copy is checked when it is loaded). Only the fields
        in :data:`~tokencredit.config.SAFE_TO_CHANGE` may differ."""
        if isinstance(saved, Path):
            if not saved.is_file():
                return
            where = saved
            try:
                saved = json.loads(saved.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError, OSError):
                return  # unreadable: the checkpoint's copy decides
        if not isinstance(saved, dict):
            return
        diffs = config_diff(saved, json.loads(json.dumps(config_to_dict(self.cfg))))
        if diffs:
            raise ConfigError(
                f"resume: the run in {str(self.out)!r} was trained with other settings ({where}): "
                f"{'; '.join(diffs)}. Resume with its settings (only {', '.join(sorted(SAFE_TO_CHANGE))} "
                f"may change) or train in a new output_dir"
            )

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.stopped_by = self.stopped_by or name
        if self._stop_requested or not self._dirty:
            raise KeyboardInterrupt
        self._stop_requested = True
        what = "Ctrl-C" if signum == signal.SIGINT else name
        print(f"\n{what}: finishing this step, then writing a checkpoint ({what} again to stop now)", flush=True)

    _on_sigint = _on_signal

    def export(self, path: Optional[str] = None) -> Path:
        """Save the final model (or adapter) and tokenizer in Hugging Face format."""
        p = Path(path) if path else self.out / "final"
        self.model.save_pretrained(p)
        self.tokenizer.save_pretrained(p)
        if self.lora:  # the adapter records its base model as given (a hub id, or an absolute path)
            from .export import record_base_model

            record_base_model(p, self.cfg.model.name, self.cfg.model.cache_dir)
        if self.critic is not None:
            torch.save(self.critic.state_dict(), p / "value_head.pt")
        return p


# ---------------------------------------------------------------------------------------
# helpers


def _plan(credit: CreditPipeline, cfg: TrainConfig, *, model=None, reference=None, teacher=None) -> SignalPlan:
    """The passes a step of ``credit`` needs under this config (before any model is loaded: a
    declared need that the setting cannot meet is a one-line ConfigError)."""
    from .models import is_lora

    try:
        return plan_signals(
            credit,
            lora=bool(cfg.model.lora or (model is not None and is_lora(model))),
            kl=cfg.loss.kl_coef > 0,
            explicit_reference=reference is not None or cfg.model.reference not in (None, "self"),
            teacher=teacher is not None or cfg.model.teacher is not None,
        )
    except PlanError as e:
        raise ConfigError(str(e)) from None


def _frozen_copy(model):
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _schedule(kind: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - frac
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * frac))
        raise ValueError(f"optim.schedule: expected constant, linear or cosine, got {kind!r}")

    return f


def _policy_loss_config(loss, lc, credit=None, max_new_tokens=None):
    """Build the registered policy loss's config from LossConfig (only the keys it has).

    Aggregation precedence: a value the user set > the one the credit spec's methods declare
    (their papers': ARCA's per-trajectory seq-mean-token-mean, Dr. GRPO's
    seq-mean-token-sum-norm with the generation budget as constant) > the loss's own default.
    """
    cls = loss.config_cls
    names = {f.name for f in dataclasses.fields(cls)}
    lc = dataclasses.replace(lc)
    if credit is not None and lc.agg_mode is None:
        lc.agg_mode = credit.loss_default("agg_mode")
    if credit is not None and lc.norm_constant is None and lc.agg_mode == "seq-mean-token-sum-norm":
        c = credit.loss_default("norm_constant")
        lc.norm_constant = float(max_new_tokens) if c == "max_new_tokens" else c
    candidates = {"clip_low": lc.clip_low, "clip_high": lc.clip_high}
    # settings that are off by default: one that is set but that this loss has no field for would
    # be silently dropped, so it is an error instead
    for k in ("dual_clip", "agg_mode", "norm_constant"):
        v = getattr(lc, k)
        if v is None:
            continue
        if k not in names:
            raise ValueError(f"loss.{k}: policy loss {loss.name!r} has no such setting (it has {sorted(names)}), got {v!r}")
        candidates[k] = v
    return cls(**{k: v for k, v in candidates.items() if k in names})


