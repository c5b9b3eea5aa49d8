"""Rollout correction in TokenCreditGRPOTrainer (issue 32.3): verl's rollout_correction settings,
computed by tokencredit.credit.losses.rollout_correction against the sampler's log-probs that TRL
records (vLLM's, or a rollout_func's), the mismatch logged, the weights on the advantages TRL's
loss receives; the combinations TRL cannot run refused in one line before any model loads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl import RewardLog, _args, _dataset  # noqa: E402

from tokencredit.integrations.trl import TokenCreditGRPOTrainer  # noqa: E402
from tokencredit.engine.rollout import HFRollout  # noqa: E402
from tokencredit.testing import tiny_model_and_tokenizer  # noqa: E402

SHIFT = 1.0  # nats taken off the sampler's log-prob of every third token


def _perturbed_rollout(model, tok):
    """A TRL rollout_func: tokencredit's HFRollout on the trainer's model (its temperature and
    top-p), returning the sampler's log-probs SHIFT nats too low on every third token."""

    def rollout(prompts, trainer):
        rb = HFRollout(model, tok).generate([list(p) for p in prompts], num_samples=1,
                                            max_new_tokens=trainer.max_completion_length,
                                            temperature=trainer.temperature, top_p=trainer.top_p)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for i in range(len(rb)):
            L = int(rb.response_mask[i].sum())
            lp = rb.behaviour_logprobs[i, :L] - SHIFT * (torch.arange(L) % 3 == 1)
            out["prompt_ids"].append(rb.prompt_ids[i][rb.prompt_mask[i].bool()].tolist())
            out["completion_ids"].append(rb.response_ids[i, :L].tolist())
            out["logprobs"].append(lp.tolist())
        return out

    return rollout


class Capturing(TokenCreditGRPOTrainer):
    """Keeps each generation's credit advantages, the advantages TRL's loss receives, the mask and
    the rollout-correction metrics of that generation."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        B, T = out["completion_ids"].shape
        metrics = {k: v[-1] for k, v in self._metrics["train"].items() if k.startswith("rollout_corr/") and v}
        self.seen.append({"credit": self.last_credit_output.advantages[:B, :T].clone(), "adv": out["advantages"].clone(),
                          "mask": out["completion_mask"].bool(), "metrics": metrics})
        return out


def _trainer(tmp_path, rollout_correction=None):
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=1.0)
    return Capturing(model=model, reward_funcs=RewardLog(), args=_args(tmp_path, max_steps=1, max_completion_length=6),
                     train_dataset=_dataset(), processing_class=tok, credit="grpo",
                     rollout_func=_perturbed_rollout(model, tok), rollout_correction=rollout_correction)


def test_tis_and_mis_against_a_perturbed_sampler(tmp_path):
    """The sampler's log-probs 1 nat low on every third token: the logged log-ratio max is 1 (the
    rest is float noise between HFRollout and TRL's forward); TIS (token, 2) multiplies those
    tokens' advantages by e^1 truncated to 2 and leaves the rest, and the update differs from the
    uncorrected one; MIS (token_k1, 2) zeroes exactly those tokens' advantages."""
    updates = {}
    for name, rc in (("none", None), ("tis", {"rollout_is": "token"}),
                     ("mis", {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0})):
        tr = _trainer(tmp_path / name, rc)
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        tr.train()
        updates[name] = {n: p.detach() - before[n] for n, p in tr.model.named_parameters()}
        (s,) = tr.seen
        if rc is None:  # no correction: TRL computes no old log-probs (aligned steps), nothing to compare
            assert torch.equal(s["adv"], s["credit"]) and not s["metrics"]
            continue
        m, mask = s["metrics"], s["mask"]
        hit = mask & (torch.arange(mask.shape[1]) % 3 == 1)[None]
        assert hit.any() and (mask & ~hit).any()
        assert m["rollout_corr/log_ratio_max"] == pytest.approx(SHIFT, abs=1e-3)
        assert abs(m["rollout_corr/log_ratio_min"]) < 1e-3
        nonzero = s["credit"] != 0
        assert (hit & nonzero).any()
        if name == "tis":
            torch.testing.assert_close(s["adv"][hit], 2.0 * s["credit"][hit], atol=1e-4, rtol=0)
            torch.testing.assert_close(s["adv"][mask & ~hit], s["credit"][mask & ~hit], atol=1e-4, rtol=1e-3)
            assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float(hit.sum() / mask.sum()))
        else:
            assert torch.all(s["adv"][hit] == 0)
            torch.testing.assert_close(s["adv"][mask & ~hit], s["credit"][mask & ~hit], atol=0, rtol=0)
            assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(float(hit.sum() / mask.sum()))
    for name in ("tis", "mis"):
        diff = max(float((updates[name][n] - updates["none"][n]).abs().max()) for n in updates["none"])
        assert diff > 1e-7, name


@pytest.mark.parametrize("settings, args, expected", [
    ({"rollout_is": "token"}, {}, r"^rollout_correction: needs the sampler's log-probs.*expected GRPOConfig\(use_vllm=True\) or a "
                                  r"rollout_func returning logprobs, got use_vllm=False and no rollout_func$"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": 0.1}, {"use_vllm": True},
     r"^vllm_importance_sampling_correction: expected False with rollout_correction .*got True$"),
    ({"rollout_is": "tokens"}, {}, r"^rollout_correction\.rollout_is: expected None or one of \['token', 'sequence'\], got 'tokens'$"),
    ({"rollout_rs": "token_k1"}, {}, r"^rollout_correction\.rollout_rs_threshold: expected a number > 0 .*got None$"),
    ({"rollout_is_thresh": 2.0}, {}, r"^rollout_correction: expected settings among .*got unknown \['rollout_is_thresh'\]$"),
])
def test_refused_in_one_line_before_the_model_loads(tmp_path, settings, args, expected):
    """A model name that does not exist: the refusal comes before TRL would load it."""
    _, tok = tiny_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match=expected):
        TokenCreditGRPOTrainer(model="no-such-org/no-such-model", reward_funcs=RewardLog(), args=_args(tmp_path, **args),
                               train_dataset=_dataset(), processing_class=tok, rollout_correction=settings)


def test_off_by_default_and_allowed_with_vllm_when_trls_own_correction_is_off(tmp_path):
    from tokencredit.integrations.trl import _rollout_correction_config

    assert not _rollout_correction_config(None, _args(tmp_path), None).active
    rc = _rollout_correction_config({"rollout_is": "sequence"}, _args(tmp_path, use_vllm=True,
                                    vllm_importance_sampling_correction=False), None)
    assert rc.rollout_is == "sequence" and rc.rollout_is_threshold == 2.0
