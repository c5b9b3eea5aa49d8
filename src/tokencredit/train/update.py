"""The update of a training step: the policy's loss over micro-batches, and the declared critic's.

* :class:`PolicyUpdate`: the policy loss (PPO / SAPO, ``tokencredit.credit.losses``) on the credit's
  advantages, micro-batch by micro-batch with gradients accumulated so that their sum is the
  whole batch's loss under its aggregation, optional KL to the reference, gradient-norm clip,
  one optimizer step per PPO epoch, the learning-rate schedule once per training step.
* :func:`critic_step`: the value head's loss on given hidden states (``CriticSpec.loss``), with
  the declared importance weights.
* :func:`policy_optimizer` and :func:`policy_loss_config`: AdamW with its schedule, and the
  policy loss's config from ``LossConfig`` and what the credit spec's methods declare.
* :class:`NonFiniteError` / :func:`check_finite`: a NaN or inf stops the run, naming the step
  and the tensor, before it reaches the weights or a checkpoint.

Used by the own trainer (``trainer.Trainer``); it knows no method names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from ..engine.forward import forward_response

__all__ = ["NonFiniteError", "PolicyUpdate", "check_finite", "critic_step", "lr_lambda", "policy_loss_config", "policy_optimizer",
           "rollout_correction_config"]


class NonFiniteError(FloatingPointError):
    """A NaN/inf appeared in training; the message names the step and the tensor."""


def check_finite(x: torch.Tensor, what: str, step: int, mask: Optional[torch.Tensor] = None) -> None:
    """Raise :class:`NonFiniteError` if ``x`` (where ``mask`` is set) holds a NaN or inf."""
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.reshape(mask.shape + (1,) * (x.dim() - mask.dim())).bool()
    if bad.any():
        raise NonFiniteError(
            f"step {step}: non-finite values in {what} (first at index {tuple(int(i) for i in bad.nonzero()[0])}); "
            f"the run stops here and the last good checkpoint is left untouched"
        )


@dataclass
class PolicyUpdate:
    """The policy's update of one step (see the module's doc). ``step`` in the calls is the
    1-based number of the step being trained, for error messages."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss: Any  # a registered policy loss: (logprobs, old_logprobs, adv, mask, cfg) -> (loss, metrics)
    loss_cfg: Any
    micro_batch_size: int
    ppo_epochs: int
    max_grad_norm: float
    kl_coef: float
    kl_estimator: str
    temperature: float
    autocast: Callable[[], ContextManager]  # bf16 autocast under precision=bf16, else nothing
    weights_changed: Callable[[], None]  # after each optimizer step (the rollout's bf16 copy re-syncs)
    # verl's rollout_correction against the behaviour log-probs (losses.rollout_correction); None: off,
    # the mismatch still logged
    rollout_correction: Any = None

    def forward(self, batch, sl: slice, want, step: int) -> Dict[str, torch.Tensor]:
        """The update's forward of micro-batch ``sl`` (with grad): token signals ``want``."""
        from ..engine.signals import token_signals

        with self.autocast():
            _, logits = forward_response(self.model, batch.input_ids[sl], batch.attention_mask[sl], batch.prompt_len)
        check_finite(logits, "policy logits", step, batch.response_mask[sl])
        return token_signals(logits, batch.response_ids[sl], temperature=self.temperature, want=want)

    def forwards(self, batch, want, step: int) -> List[Dict[str, torch.Tensor]]:
        """Every micro-batch's update forward, kept (with their graphs) for the update that the
        credit computed from their detached signals will drive (``optim.one_pass``)."""
        mb = self.micro_batch_size
        return [self.forward(batch, slice(s, s + mb), want, step) for s in range(0, len(batch), mb)]

    def __call__(self, batch, adv, old_logprobs, ref_logprobs, step: int, pre=None) -> Dict[str, float]:
        """Train the policy on ``adv``; ``pre``: the first epoch's forwards, already run."""
        from ..credit.losses import aggregate, kl_penalty
        from ..credit.losses.rollout_correction import rollout_correction

        N = batch.response_ids.shape[0]
        # the training policy's old log-probs against the sampler's: TIS weights multiply the
        # per-token loss, tokens MIS rejects leave the loss's mask (verl's rollout_correction)
        is_w, keep, corr_metrics = rollout_correction(old_logprobs, batch.behaviour_logprobs, batch.response_mask,
                                                      self.rollout_correction)
        mask = keep
        mb = self.micro_batch_size
        total_tokens = float(mask.sum())
        agg_mode = self.loss_cfg.agg_mode
        norm_constant = getattr(self.loss_cfg, "norm_constant", None)
        seq_mode = agg_mode.startswith("seq-")
        n_rows = float((mask.sum(1) > 0).sum())
        sums: Dict[str, float] = {}
        ent_sum = 0.0
        grad_norm = 0.0
        for epoch in range(self.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for s in range(0, N, mb):
                sl = slice(s, s + mb)
                m = mask[sl]
                if m.sum() == 0:
                    continue
                # the first epoch's entropy (logged) comes out of the same pass over the logits; with
                # optim.one_pass its forward already ran (pre), before the credit
                want = ("logprobs", "entropy") if epoch == 0 else ("logprobs",)
                sig = pre[s // mb] if pre is not None and epoch == 0 else self.forward(batch, sl, want, step)
                lp = sig["logprobs"]
                loss, lm = self.loss(lp, old_logprobs[sl], adv[sl], m, self.loss_cfg,
                                     loss_weights=is_w[sl] if is_w is not None else None)
                if self.kl_coef > 0:
                    kl = aggregate(kl_penalty(lp, ref_logprobs[sl], self.kl_estimator), m, agg_mode, norm_constant=norm_constant)
                    loss = loss + self.kl_coef * kl
                    lm = {**lm, "kl": float(kl.detach())}
                check_finite(loss.detach(), "policy loss", step)
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
                    sums[k] = sums.get(k, 0.0) + float(v) * scale / self.ppo_epochs
                sums["policy"] = sums.get("policy", 0.0) + float(loss.detach()) * scale / self.ppo_epochs
                if epoch == 0:
                    ent_sum += float((sig["entropy"].detach() * batch.response_mask[sl]).sum())
            params = [p for p in self.model.parameters() if p.requires_grad]
            gn = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            if not torch.isfinite(gn):
                raise NonFiniteError(
                    f"step {step}: non-finite gradient norm ({float(gn)}) in the policy update; "
                    f"the run stops here and the last good checkpoint is left untouched"
                )
            grad_norm = float(gn)
            self.optimizer.step()
            self.weights_changed()
        self.scheduler.step()
        out = {_TRL_NAMES.get(k, f"loss/{k}"): v for k, v in sums.items()}
        out["grad_norm"] = grad_norm
        out["entropy"] = ent_sum / max(float(batch.response_mask.sum()), 1.0)
        out.update(corr_metrics)
        return out


#: the loss's metrics that TRL's GRPOTrainer logs too, under TRL's names (each logged once);
#: the rest are logged as ``loss/NAME`` (``loss/ppo/ratio_mean``, ...)
_TRL_NAMES = {
    "policy": "loss",
    "kl": "kl",
    "ppo/clip_frac_low": "clip_ratio/low_mean",
    "ppo/clip_frac_high": "clip_ratio/high_mean",
    "ppo/clip_frac": "clip_ratio/region_mean",
}


def critic_step(critic, optimizer, spec, hidden: torch.Tensor, *, rewards, returns, mask, weights, steps: int, step: int) -> float:
    """``steps`` optimizer steps of the value head on ``hidden`` (detached final hidden states)
    with the declared loss ``spec.loss``; the last loss."""
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        head_out = critic(hidden[:, :-1]).squeeze(-1)
        loss = spec.loss(head_out, rewards=rewards, returns=returns, mask=mask, weights=weights)
        check_finite(loss.detach(), "critic loss", step)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor of step ``step``: linear warm-up, then constant, linear or cosine."""

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


def policy_optimizer(model, o, device_type: str, total_steps: int) -> Tuple[torch.optim.Optimizer, Any]:
    """AdamW on the trainable parameters (torch's fused kernel where it exists) and its
    schedule, from ``OptimConfig`` ``o``."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = o.fused_adamw and device_type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, **({"fused": True} if fused else {}))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o.schedule, o.warmup_steps, total_steps))


def policy_loss_config(loss, lc, credit=None, max_new_tokens=None):
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
    for k in ("dual_clip", "agg_mode", "norm_constant", "epsilon_high", "importance_sampling_level",
              "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"):
        v = getattr(lc, k)
        if v is None or (k == "importance_sampling_level" and v == "token"):
            continue
        if k not in names:
            raise ValueError(f"loss.{k}: policy loss {loss.name!r} has no such setting (it has {sorted(names)}), got {v!r}")
        candidates[k] = v
    return cls(**{k: v for k, v in candidates.items() if k in names})


def rollout_correction_config(lc):
    """verl's rollout_correction settings of ``LossConfig`` ``lc`` (``losses.rollout_correction``);
    a ValueError naming the field for a bad combination."""
    from ..credit.losses.rollout_correction import RolloutCorrectionConfig

    return RolloutCorrectionConfig(
        rollout_is=lc.rollout_is, rollout_is_threshold=lc.rollout_is_threshold,
        rollout_is_batch_normalize=lc.rollout_is_batch_normalize, rollout_rs=lc.rollout_rs,
        rollout_rs_threshold=lc.rollout_rs_threshold,
    )
