"""--precision: bf16 generation copy + autocast with fp32 master weights; auto resolved and recorded."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import tokencredit.engine.precision as precision
from tokencredit.train.config import ConfigError
from tokencredit.engine.rollout import HFRollout
from tokencredit.testing import tiny_model_and_tokenizer
from test_trainer import _cfg, _trainer

PROMPTS = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "3+4="}]]


def test_bf16_run_trains_keeps_fp32_master_weights_and_records_precision(tmp_path):
    cfg = _cfg(tmp_path, steps=2, precision="bf16")
    tr = _trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    last = tr.train()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "bf16"
    # fp32 master weights and AdamW state, changed by the two updates
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    assert all(v.dtype == torch.float32 for s in tr.optimizer.state.values() for v in s.values() if v.is_floating_point())
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    assert last["step"] == 2.0 and all(torch.isfinite(torch.tensor(v)) for k, v in last.items() if k.startswith("loss/"))
    # generation ran on the bf16 copy, synced to the updated weights
    gen = tr.rollout.generation_model()
    assert gen is not tr.model and all(p.dtype == torch.bfloat16 for p in gen.parameters())
    for n, p in gen.named_parameters():
        assert torch.equal(p, dict(tr.model.named_parameters())[n].detach().to(torch.bfloat16)), n


def test_fp32_path_never_enters_autocast_nor_copies_the_model(tmp_path, monkeypatch):
    """fp32 is today's code path: no autocast region, generation on the model itself."""
    def refuse(*a, **k):
        raise AssertionError("autocast entered under precision=fp32")

    monkeypatch.setattr(torch, "autocast", refuse)
    tr = _trainer(_cfg(tmp_path, steps=2, precision="fp32"))
    tr.train()
    assert tr.rollout.generation_model() is tr.model and tr.rollout.dtype is None


@pytest.mark.parametrize("has_units, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_is_resolved_from_the_cpu_and_recorded(tmp_path, monkeypatch, has_units, expected):
    monkeypatch.setattr(precision, "cpu_has_bf16_units", lambda: has_units)
    tr = _trainer(_cfg(tmp_path, steps=1, precision="auto", device="cpu"))
    assert tr.cfg.precision == expected
    tr.train()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == expected


def test_resume_keeps_the_precision(tmp_path, monkeypatch):
    _trainer(_cfg(tmp_path, steps=1, precision="bf16")).train()
    with pytest.raises(ConfigError, match=r"precision: 'bf16' -> 'fp32'"):
        _trainer(_cfg(tmp_path, steps=2, precision="fp32", resume=True))
    # auto resolving to the run's own precision resumes
    monkeypatch.setattr(precision, "cpu_has_bf16_units", lambda: True)
    tr = _trainer(_cfg(tmp_path, steps=2, precision="auto", device="cpu", resume=True))
    assert tr.train()["step"] == 2.0


def test_bad_precision_is_one_line_before_any_model():
    with pytest.raises(ConfigError, match=r"^precision: expected one of .*'fp32'.*got 'fp16'$"):
        _cfg(__import__("pathlib").Path("/nonexistent"), precision="fp16")


def test_resolve_precision():
    assert precision.resolve_precision("fp32", "cpu") == "fp32"
    assert precision.resolve_precision("bf16", "cpu") == "bf16"
    assert precision.resolve_precision("auto", "mps") == "fp32"
    with pytest.raises(ValueError, match="precision: expected one of"):
        precision.resolve_precision("half")


def test_bf16_rollout_copy_follows_weight_changes_when_told():
    model, tok = tiny_model_and_tokenizer(seed=0)
    ro = HFRollout(model, tok, dtype=torch.bfloat16)
    rb = ro.generate(PROMPTS, num_samples=2, max_new_tokens=4, temperature=1.0, seed=0)
    assert rb.behaviour_logprobs.dtype == torch.float32 and (rb.behaviour_logprobs <= 0).all()
    w = model.get_output_embeddings().weight
    with torch.no_grad():
        w.add_(1.0)  # what an optimizer step does
    assert not torch.equal(ro.generation_model().get_output_embeddings().weight, w.detach().to(torch.bfloat16))
    ro.weights_changed()
    copy_w = ro.generation_model().get_output_embeddings().weight
    assert copy_w.dtype == torch.bfloat16 and torch.equal(copy_w, w.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype: expected a floating torch dtype or None, got torch.int64"):
        HFRollout(model, tok, dtype=torch.int64)


def test_a_run_written_before_the_new_fields_resumes_at_their_old_equivalent():
    from tokencredit.train.config import TrainConfig, config_diff, config_to_dict

    new = json.loads(json.dumps(config_to_dict(TrainConfig())))
    old = json.loads(json.dumps(new))
    del old["precision"], old["optim"]["one_pass"], old["rollout"]["max_batch_size"], old["rollout"]["sampler"]
    # the sampler's default changed after such runs: a resume names the one that continues them
    assert config_diff(old, new) == ["rollout.sampler: 'multinomial' -> 'inverse_cdf'"]
    same = json.loads(json.dumps(new))
    same["rollout"]["sampler"] = "multinomial"
    assert config_diff(old, same) == []
    changed = dict(same, precision="bf16")
    assert config_diff(old, changed) == ["precision: 'fp32' -> 'bf16'"]


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_bf16_old_logprobs_are_the_updates_numerics_not_the_bf16_rollouts(tmp_path, monkeypatch, ppo_epochs):
    """GRPO declares no policy pass, so in fp32 the old log-probs are the rollout's. Under bf16
    the rollout samples from a bf16 weight copy and the update runs under autocast, whose
    log-probs differ; the old log-probs then come from the update's numerics: its own first
    forward with one epoch (no separate pass), a policy pass with several. The first epoch's
    ratio is 1 on every token."""
    import tokencredit.engine.passes as passes

    seen = []
    real = passes.run_passes
    monkeypatch.setattr(passes, "run_passes", lambda plan, *a, **k: (seen.append(plan.passes), real(plan, *a, **k))[1])
    cfg = _cfg(tmp_path, credit="grpo", precision="bf16", steps=1)
    cfg.optim = dataclasses.replace(cfg.optim, ppo_epochs=ppo_epochs)
    cfg.log = dataclasses.replace(cfg.log, save_rollouts=False)  # a saved batch runs every pass
    cfg.rollout = dataclasses.replace(cfg.rollout, prompts_per_step=3, samples_per_prompt=4)
    tr = _trainer(cfg)
    m = tr.train_step()
    assert m["grad_norm"] > 0.0
    if ppo_epochs == 1:
        assert all("policy" not in p for p in seen)  # the update's forward gave them
        assert m["loss/ppo/ratio_max"] == 1.0 and m["loss/ppo/ratio_min"] == 1.0
    else:
        assert any("policy" in p for p in seen)
    # in fp32 the plan is unchanged: GRPO keeps the rollout's log-probs
    tr32 = _trainer(_cfg(tmp_path / "fp32", credit="grpo", precision="fp32"))
    assert "logprobs" not in tr32.plan.policy
