"""Bad input, user code and faults never hang, lie or run code (issue 13).

Each section guards one failure found by probing the command line as a new user would; the
tiny random model (tokencredit.testing) keeps every test to a second or two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import threading
import typing
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokencredit.train.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from tokencredit.cli import main
from tokencredit.train.config import (
    ConfigError,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    _from_dict,
    load_config,
)
from tokencredit.data.tasks import DatasetError, make_task
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

# -- rewards used by the runs below (imported by name through task.reward_fn) ------------------


def crc_reward(completion: str, example) -> float:
    return float(zlib.crc32(completion.encode()) % 2)


def raising_reward(completion: str, example) -> float:
    raise RuntimeError("reward server down")


def nan_reward(completion: str, example) -> float:
    return float("nan")


def five_reward(completion: str, example) -> float:
    return 5.0


def string_reward(completion: str, example) -> str:
    return "1.0"


_RELEASE = threading.Event()


def hanging_reward(completion: str, example) -> float:
    _RELEASE.wait()  # hangs until the test releases it (never, within the timeout)
    return 1.0


# -- helpers ----------------------------------------------------------------------------------


def _cfg(out: Path, credit="grpo", steps=1, reward="crc_reward", **kw) -> TrainConfig:
    return TrainConfig(
        credit=credit,
        steps=steps,
        output_dir=str(out),
        save_every=kw.pop("save_every", 1),
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=16, n_eval=2, reward_fn=f"test_reliability:{reward}",
                        reward_timeout_s=kw.pop("reward_timeout_s", 5.0)),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, temperature=1.0),
        optim=OptimConfig(lr=1e-3, micro_batch_size=4),
        log=LogConfig(eval_every=kw.pop("eval_every", 100), eval_samples=1, progress=False, eval_at_start=False),
        **kw,
    )


def _trainer(cfg: TrainConfig) -> Trainer:
    model, tok = tiny_model_and_tokenizer(seed=0)
    return Trainer(cfg, model=model, tokenizer=tok)


def _rows(path: Path):
    def strict(c):  # NaN / Infinity are not JSON
        raise ValueError(f"not JSON: {c}")

    return [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test: errors must come before."""
    import tokencredit.engine.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(models, "resolve_model", boom)
    monkeypatch.setattr(models, "load_frozen", boom)


@pytest.fixture
def tiny_cli(monkeypatch):
    """The command line with the tiny model in place of the named one."""
    import tokencredit.engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))


def _cli(argv):
    """main(argv) -> (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _tree(root: Path):
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


TINY_FLAGS = shlex.split(
    "--model.name tiny --task.name add1 --task.n-train 16 --task.n-eval 2 "
    "--task.reward-fn test_reliability:crc_reward --rollout.prompts-per-step 2 --rollout.samples-per-prompt 2 "
    "--rollout.max-new-tokens 4 --optim.micro-batch-size 4 --log.eval-samples 1 --log.no-progress "
    "--log.no-eval-at-start --save-every 1"
)


# -- 1. rewards at evaluation go through the training guard ----------------------------------


def test_a_hanging_reward_cannot_hang_evaluation(tmp_path):
    tr = _trainer(_cfg(tmp_path / "run", reward="hanging_reward", reward_timeout_s=0.1))
    try:
        m = tr.evaluate()
    finally:
        _RELEASE.set()  # let the abandoned threads end
    n = len(tr.task.eval) * (1 + tr.cfg.log.eval_samples)
    assert m["eval/failed_timeout"] == n and m["eval/failed_error"] == 0
    assert m["eval/greedy_acc"] == 0.0


@pytest.mark.parametrize("reward", ["raising_reward", "nan_reward", "five_reward", "string_reward"])
def test_bad_rewards_are_counted_failures_in_training_and_eval(tmp_path, reward):
    """A raising reward, NaN, 5.0 on a [0, 1] task and the string "1.0" are failures scored 0,
    in training and at eval alike; the run goes on (step 1 of 2: a run whose reward fails every
    call of every step stops at its last, tests/test_reward_contract.py) and its metrics are JSON."""
    tr = _trainer(_cfg(tmp_path / "run", reward=reward, steps=2))
    row = json.loads(json.dumps({**tr.train_step(), **tr.evaluate()}, allow_nan=False))
    n_eval = len(tr.task.eval) * (1 + tr.cfg.log.eval_samples)
    assert row["eval/failed_error"] == n_eval and row["eval/failed_timeout"] == 0
    assert row["eval/greedy_acc"] == 0.0 and row["eval/mean@1"] == 0.0
    assert row["reward/failed_error"] == 4 and row["reward"] == 0.0  # 2 prompts x 2 samples


# -- 2. every config field is validated before anything loads -------------------------------


def _leaf_fields(cls=TrainConfig, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def _wrong_type(tp):
    """Values of another type than ``tp`` (the test's own notion, independent of the library's)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    optional = origin is typing.Union and type(None) in args
    if optional:
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    pool = {
        int: ["three", 1.5, True, [1], {"a": 1}],
        float: ["x", True, [0.5], float("nan"), float("inf"), float("-inf")],
        bool: [1, 0, "yes", 1.0, [True]],
        str: [3, 1.5, True, ["a"], "", "   "],
    }.get(tp)
    if origin is typing.Literal:
        pool = ["sideways", 3, True]
    elif origin is tuple and args[-1] is Ellipsis:
        pool = ["q_proj", 3, [3], ["ok", 4], [""]]
    elif origin is tuple:
        pool = [0.9, [0.9], ["a", "b"], [0.9, 0.99, 0.5], [True, 0.9]]
    assert pool is not None, f"no wrong-type values for {tp}"
    return pool if optional else pool + [None]


_INT_LE0 = st.integers(max_value=0)
_POS_INT_BAD = st.integers(max_value=0)
_FLOAT_LT0 = st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)
_FLOAT_LE0 = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)

#: the test's own table of out-of-range values per field; None: any value of the right type is
#: allowed. Every field must be listed (a new field fails here until it is thought about).
OUT_OF_RANGE = {
    "credit": st.sampled_from(["nope", "grpo+grpo", "taco+grpo+", "dapo+taco"]),
    "credit_args": st.sampled_from([("x",), ("taco.lam",), ("nope.x=1",), ("grpo.nope=1",)]),
    "steps": _INT_LE0,
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32)),
    "output_dir": st.sampled_from([__file__, os.path.join(__file__, "sub")]),  # a file, under a file
    "device": st.sampled_from(["gpu", "cuda0", "tpu", "CPU"]),
    "threads": _INT_LE0,
    "retain_memory": None,
    "precision": st.sampled_from(["fp16", "BF16", "half"]),
    "save_every": _INT_LE0,
    "keep_last": _INT_LE0,
    "resume": None,
    "overwrite": None,
    "model.name": None,
    "model.cache_dir": None,
    "model.lora": None,
    "model.lora_r": _INT_LE0,
    "model.lora_alpha": _INT_LE0,
    "model.lora_targets": st.just(()),
    "model.reference": None,
    "model.teacher": None,
    "task.name": st.sampled_from(["mul2", "GSM8K", "nope"]),
    "task.path": None,
    "task.reward_fn": st.sampled_from(["no_colon", "mod:", ":fn", "a:b:c d", "surely_not_a_module_4242:f"]),
    "task.reward_timeout_s": _FLOAT_LE0,
    "task.n_train": _INT_LE0,
    "task.n_eval": _INT_LE0,
    "data.path": st.sampled_from(["/surely/not/here.jsonl", "not a hub id"]),
    "data.split": None,
    "data.eval_path": st.just("eval.jsonl"),  # without data.path
    "data.eval_split": st.just("test"),  # without data.path
    "data.eval_fraction": st.one_of(_FLOAT_LE0, st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
    "data.prompt_column": None,
    "data.answer_column": st.just("solution"),  # without data.path
    "data.system_prompt": st.just("Be brief."),  # without data.path
    "data.prompt_template": st.just("no placeholder"),
    "reward.funcs": st.sampled_from([("nope",), ("surely_not_a_module_4242:f",), ("test_reliability:crc_reward",)]),
    "reward.weights": st.just((1.0, 2.0)),  # two weights for no function
    "reward.max_failing_steps": _INT_LE0,
    "reward.clipped_warn_ratio": st.one_of(_FLOAT_LE0, st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False)),
    "rollout.prompts_per_step": _INT_LE0,
    "rollout.samples_per_prompt": st.integers(max_value=1),
    "rollout.max_new_tokens": _INT_LE0,
    "rollout.max_batch_size": _INT_LE0,
    "rollout.temperature": _FLOAT_LT0,
    "rollout.top_p": st.one_of(_FLOAT_LE0, st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False)),
    "rollout.sampler": None,
    "rollout.backend": st.sampled_from(["VLLM", "sglang", "hf "]),
    "rollout.enforce_eager": None,
    "optim.lr": _FLOAT_LE0,
    "optim.weight_decay": _FLOAT_LT0,
    "optim.betas": st.sampled_from([(0.9, 1.0), (-0.1, 0.99), (1.5, 0.5)]),
    "optim.warmup_steps": st.integers(max_value=-1),
    "optim.schedule": None,
    "optim.max_grad_norm": _FLOAT_LE0,
    "optim.micro_batch_size": _INT_LE0,
    "optim.ppo_epochs": _INT_LE0,
    "optim.fused_adamw": None,
    "optim.one_pass": None,
    "loss.policy_loss": st.sampled_from(["nope", "PPO", "grpo"]),
    "loss.agg_mode": st.sampled_from(["mean", "token_mean", "seq-mean"]),
    "loss.norm_constant": _FLOAT_LE0,
    "loss.clip_low": st.one_of(_FLOAT_LT0, st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
    "loss.clip_high": _FLOAT_LT0,
    "loss.dual_clip": st.floats(max_value=1.0, allow_nan=False, allow_infinity=False),
    "loss.importance_sampling_level": st.sampled_from(["seq", "Token", "tokens"]),
    "loss.epsilon_high": st.floats(max_value=0.999, allow_nan=False, allow_infinity=False),
    "loss.clip_cov_ratio": st.one_of(_FLOAT_LE0, st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False)),
    "loss.clip_cov_lb": None,
    "loss.clip_cov_ub": None,
    "loss.kl_cov_ratio": st.one_of(_FLOAT_LE0, st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False)),
    "loss.ppo_kl_coef": _FLOAT_LT0,
    "loss.rollout_is": st.sampled_from(["tokens", "seq", "Token"]),
    "loss.rollout_is_threshold": _FLOAT_LE0,
    "loss.rollout_is_batch_normalize": None,
    "loss.rollout_rs": st.sampled_from(["token_k9", "seq_max_k1", " , "]),
    "loss.rollout_rs_threshold": _FLOAT_LE0,
    "loss.kl_coef": _FLOAT_LT0,
    "loss.kl_estimator": st.sampled_from(["k4", "kl", "K3"]),
    "critic.lr": _FLOAT_LE0,
    "critic.steps": _INT_LE0,
    "dapo.dynamic_sampling": None,
    "dapo.max_rounds": _INT_LE0,
    "dapo.overlong_shaping": None,
    "dapo.overlong_cache": st.one_of(_INT_LE0, st.integers(min_value=33)),  # > max_new_tokens (32)
    "log.eval_every": _INT_LE0,
    "log.eval_at_start": None,
    "log.eval_samples": st.integers(max_value=-1),
    "log.save_rollouts": None,
    "log.tensorboard": None,
    "log.wandb": None,
    "log.wandb_project": None,
    "log.progress": None,
}
#: the method settings (credit_config.METHOD.FIELD, each method's own config class, bounded by its
#: __post_init__) are not in this table: tests/test_config_methods.py walks every one of them
FIELDS = {k: v for k, v in _leaf_fields() if not k.startswith("credit_config.")}


def test_the_table_covers_every_config_field():
    assert sorted(OUT_OF_RANGE) == sorted(FIELDS)


def _invalid(path):
    wrong = st.sampled_from(_wrong_type(FIELDS[path]))
    return wrong if OUT_OF_RANGE.get(path) is None else st.one_of(wrong, OUT_OF_RANGE[path])


def _set(cfg, path, value):
    *sections, name = path.split(".")
    obj = cfg
    for s in sections:
        obj = getattr(obj, s)
    object.__setattr__(obj, name, value)  # no __post_init__: the Trainer must check by itself


def _assert_names_the_field(msg, path):
    assert "\n" not in msg.strip(), msg
    assert path.rsplit(".", 1)[-1] in msg, (path, msg)


@pytest.mark.parametrize("path", sorted(FIELDS))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_invalid_value_of_any_field_is_a_one_line_error_before_any_model_loads(no_model_loading, tmp_path, path, data):
    value = data.draw(_invalid(path), label=path)
    unused = str(tmp_path / "never-created")
    cfg = TrainConfig(output_dir=unused)
    _set(cfg, path, value)
    with pytest.raises(ValueError) as ei:
        Trainer(cfg)
    _assert_names_the_field(str(ei.value), path)
    # the same value in a YAML file, through the command line: one line on stderr, exit code 2
    section, _, name = path.rpartition(".")
    doc = {name: list(value) if isinstance(value, tuple) else value}
    if section:
        doc = {section: doc}
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(doc))
    code, err = _cli(["train", "--config", str(f)] + (["--output-dir", unused] if path != "output_dir" else []))
    assert code == 2, (path, value, err)
    _assert_names_the_field(err, path)
    assert err.startswith("tokencredit train: ") and "Traceback" not in err
    assert not Path(unused).exists()


@pytest.mark.parametrize("flags,field", [
    ("--optim.micro-batch-size -1", "optim.micro_batch_size"),
    ("--optim.ppo-epochs 0", "optim.ppo_epochs"),
    ("--optim.micro-batch-size 0", "optim.micro_batch_size"),
    ("--log.eval-every 0", "log.eval_every"),
    ("--rollout.max-new-tokens 0", "rollout.max_new_tokens"),
    ("--rollout.prompts-per-step 0", "rollout.prompts_per_step"),
    ("--credit nope", "credit"),
])
def test_the_settings_that_trained_nothing_or_failed_late_fail_first(tmp_path, no_model_loading, flags, field):
    code, err = _cli(["train", "--output-dir", str(tmp_path / "run")] + shlex.split(flags))
    assert code == 2 and err.strip().count("\n") == 0 and err.startswith(f"tokencredit train: {field}: expected")
    assert not (tmp_path / "run").exists()


def test_a_yaml_value_of_the_wrong_type_names_the_field(tmp_path, no_model_loading):
    f = tmp_path / "run.yaml"
    f.write_text("steps: three\n")
    with pytest.raises(ConfigError, match=r"^steps: expected an integer >= 1, got 'three'$"):
        load_config(str(f))


def test_an_output_dir_that_is_a_file_fails_before_the_model_loads(tmp_path, no_model_loading):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="output_dir: expected a directory.*file"):
        Trainer(TrainConfig(output_dir=str(f)))


# -- 3. --resume with other settings is refused ----------------------------------------------


def test_resume_with_changed_settings_is_refused_and_more_steps_are_allowed(tmp_path):
    out = tmp_path / "run"
    _trainer(_cfg(out, "taco", steps=1)).train()
    before = _tree(out)
    changed = dataclasses.replace(_cfg(out, "grpo", steps=2, resume=True), seed=3)
    with pytest.raises(ConfigError) as ei:
        _trainer(changed)
    msg = str(ei.value)
    diffs = msg.split(". Resume with")[0]
    assert "credit: 'taco' -> 'grpo'" in diffs and "seed: 0 -> 3" in diffs and "steps" not in diffs
    assert "\n" not in msg
    assert _tree(out) == before  # config.json and metrics.jsonl untouched
    # config.json overwritten by hand to match: the checkpoint's own copy still refuses
    saved = (out / "config.json").read_text()
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(changed)))
    tr = _trainer(changed)
    with pytest.raises(ConfigError, match=r"step_00000001.*credit: 'taco' -> 'grpo'"):
        tr.train()
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [1.0]
    (out / "config.json").write_text(saved)
    # what is safe to change: more steps, logging
    ok = _cfg(out, "taco", steps=2, resume=True, eval_every=1)
    _trainer(ok).train()
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [1.0, 2.0]


# -- 4. loading a checkpoint never runs code -------------------------------------------------


class _Payload:
    """Unpickling this creates a directory: the stand-in for a shell command."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_a_crafted_checkpoint_is_refused_without_running_it(tmp_path, no_model_loading):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(TrainConfig(output_dir=str(run)))))
    marker = tmp_path / "pwned"
    bad = run / "checkpoints" / "step_00000001" / "state.pt"
    torch.save({"step": 1, "rng": _Payload(str(marker))}, bad)
    code, err = _cli(["eval", "--run", str(run)])
    assert not marker.exists()
    assert code == 2 and str(bad) in err and "refused" in err and err.strip().count("\n") == 0
    with pytest.raises(CheckpointError, match="refused") as ei:  # and through the library
        load_checkpoint(bad)
    assert ei.value.unsafe and not marker.exists()


def test_a_checkpoint_holds_only_tensors_and_plain_values(tmp_path):
    """What the trainer saves (RNG states, optimizer, STARE's state, the critic) loads with
    weights_only=True, and restores the RNGs exactly."""
    import random

    import numpy as np

    out = tmp_path / "run"
    tr = _trainer(_cfg(out, "gae", steps=1))
    tr.train()
    sd = torch.load(out / "checkpoints" / "step_00000001" / "state.pt", weights_only=True)
    assert sd["critic"] is not None
    from tokencredit.train.checkpoint import rng_state, set_rng_state

    set_rng_state(sd["rng"])
    a = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(sd["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == a
    assert set(rng_state()) == set(sd["rng"])


# -- 5. user errors: one line, exit 2; tracebacks only with --debug ---------------------------


def test_user_errors_are_one_line_with_exit_code_2(tmp_path, no_model_loading):
    code, err = _cli(["train", "--credit", "nope", "--output-dir", str(tmp_path / "r")])
    assert code == 2 and err.strip().count("\n") == 0
    assert err.startswith("tokencredit train: credit: expected a credit spec") and "'nope'" in err
    # --debug: the traceback, i.e. the exception itself
    with pytest.raises(ConfigError, match="credit"):
        main(["train", "--credit", "nope", "--output-dir", str(tmp_path / "r"), "--debug"])
    # eval with a bad --run
    code, err = _cli(["eval", "--run", str(tmp_path / "nowhere")])
    assert code == 2 and "--run" in err and err.strip().count("\n") == 0


def test_an_unknown_method_is_a_value_error():
    from tokencredit.credit.registry import get_method
    from tokencredit.credit.spec import CreditPipeline

    with pytest.raises(ValueError, match=r"^unknown credit method 'nope'; registered: \["):
        get_method("nope")
    with pytest.raises(ValueError, match="unknown credit method 'zzz'"):
        CreditPipeline("grpo+zzz")


def test_a_malformed_dataset_line_names_the_file_and_line(tmp_path, no_model_loading):
    f = tmp_path / "data.jsonl"
    f.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": \n')
    with pytest.raises(DatasetError, match=rf"{f}:2 is not JSON"):
        make_task("gsm8k", path=str(f), n_train=1, n_eval=1)
    code, err = _cli(["train", "--task.name", "gsm8k", "--task.path", str(f), "--output-dir", str(tmp_path / "r")])
    assert code == 2 and f"{f}:2" in err and err.strip().count("\n") == 0


# -- 6. a truncated latest checkpoint: named, skipped; .tmp_step_* leftovers removed ----------


def test_a_truncated_latest_checkpoint_falls_back_with_a_warning(tmp_path):
    out = tmp_path / "run"
    _trainer(_cfg(out, "grpo", steps=2)).train()
    latest = out / "checkpoints" / "step_00000002" / "state.pt"
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 3])
    tr = _trainer(_cfg(out, "grpo", steps=3, resume=True))
    with pytest.warns(CheckpointWarning, match="step_00000002"):
        tr.train()
    assert tr.step == 3
    # steps 2 and 3 were trained again from step 1's checkpoint; step 2's first row (past the
    # checkpoint resumed from) was dropped, so no step is logged twice
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == [1.0, 2.0, 3.0]
    # nothing usable at all: an error that names the folder
    for ck in (out / "checkpoints").iterdir():
        (ck / "state.pt").write_bytes(b"not a checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match="every checkpoint under .*checkpoints.* is damaged"):
            load_latest_checkpoint(out / "checkpoints")


def test_leftover_temporary_checkpoints_are_removed_at_the_next_save(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"x": torch.ones(2)})
    for name in (".tmp_step_00000002_999", ".tmp_step_00000007_12"):  # kills during saves
        (root / name).mkdir()
        (root / name / "state.pt").write_bytes(b"half")
    save_checkpoint(root, 2, {"x": torch.ones(2)})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert latest_checkpoint(root).name == "step_00000002"


# -- 7. an empty eval split is an error, never an accuracy of 0 ------------------------------


def test_an_empty_eval_split_is_refused(tmp_path, no_model_loading):
    with pytest.raises(ConfigError, match="task.n_eval: expected an integer >= 1, got 0"):
        TrainConfig(task=TaskConfig(n_eval=0))
    cfg = _cfg(tmp_path / "run")
    task = make_task("add1", n_train=4, n_eval=1)
    task.eval.clear()
    model, tok = tiny_model_and_tokenizer()
    with pytest.raises(ConfigError, match="non-empty eval split"):
        Trainer(cfg, model=model, tokenizer=tok, task=task)
    tr = _trainer(cfg)
    tr.task.eval.clear()
    with pytest.raises(ConfigError, match="non-empty eval split"):
        tr.evaluate()


# -- 8. an interrupted train exits 130 -------------------------------------------------------


def test_an_interrupted_train_exits_130(tmp_path, tiny_cli, monkeypatch):
    real, calls = Trainer.train_step, {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 2:  # between steps: step 1 is checkpointed, then the run stops
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "run"
    code, err = _cli(["train", "--steps", "3", "--output-dir", str(out)] + TINY_FLAGS)
    assert code == 130 and "interrupted at step 1 of 3" in err
    assert not (out / "final").exists()
    # 10. resuming, then resuming the finished run: no empty "last step:"
    monkeypatch.setattr(Trainer, "train_step", real)
    assert _cli(["train", "--steps", "3", "--output-dir", str(out), "--resume"] + TINY_FLAGS)[0] == 0
    out_text = io.StringIO()
    with contextlib.redirect_stdout(out_text):
        code, _ = _cli(["train", "--steps", "3", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 0
    assert "nothing to train: the run is at step 3 of 3" in out_text.getvalue()
    assert "last step:" not in out_text.getvalue()


# -- 9. eval --run never changes the run ------------------------------------------------------


def test_eval_of_a_run_writes_elsewhere_and_leaves_the_run_unchanged(tmp_path, tiny_cli, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.chdir(a)  # the run stores a relative output_dir, as from the command line
    assert _cli(["train", "--steps", "1", "--output-dir", "run", "--log.eval-every", "1"] + TINY_FLAGS)[0] == 0
    run = a / "run"
    assert json.loads((run / "config.json").read_text())["output_dir"] == "run"
    before = _tree(run)
    monkeypatch.chdir(b)  # from another directory
    out_text = io.StringIO()
    with contextlib.redirect_stdout(out_text):
        code, err = _cli(["eval", "--run", str(run), "--trust-remote-code"])  # its config names a task.reward_fn
    assert code == 0, err
    assert _tree(run) == before  # nothing in the run written or touched
    assert list(b.iterdir()) == []  # and no stray tree where the command was run
    result = json.loads((a / "run-eval" / "eval_step_00000001.json").read_text())
    assert result["step"] == 1 and "eval/greedy_acc" in result
    assert json.loads(out_text.getvalue())["eval/greedy_acc"] == result["eval/greedy_acc"]
    assert (a / "run-eval" / "eval" / "samples_step_00000001.jsonl").exists()


# -- 10. the test command prints pytest's summary line ----------------------------------------


def test_the_test_command_gives_q_once():
    """pytest -q -q hides the summary line ("N passed in S s"): -q once across both places."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"].get("addopts", "")
    script = [line for line in (ROOT / "scripts" / "test.sh").read_text().splitlines()
              if "-m pytest" in line and not line.lstrip().startswith("#")]  # each pytest run (not pip's -q)
    assert len(script) >= 2, script  # the vLLM backend's tests and the suite
    for line in script:
        words = shlex.split(addopts) + shlex.split(line)
        assert sum(w.count("q") for w in words if w.startswith("-") and not w.startswith("--") and set(w[1:]) <= {"q"}) == 1, line
        assert sum(w == "--quiet" for w in words) == 0, line


# == issue 21: run folders, signals, limits =====================================================
# Each test below failed on the code before issue 21 (each was run against it once).


def _lines(path: Path):
    """metrics.jsonl's lines, each a whole JSON object (a torn line fails here)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- 21.1 a run folder belongs to one run ------------------------------------------------------


def test_a_fresh_train_into_a_folder_with_a_run_is_refused_and_overwrite_moves_it_aside(tmp_path, tiny_cli, monkeypatch):
    out = tmp_path / "run"
    assert _cli(["train", "--steps", "2", "--output-dir", str(out)] + TINY_FLAGS)[0] == 0
    before = _tree(out)
    # refused before any model loads, nothing in the folder touched
    import tokencredit.engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    code, err = _cli(["train", "--steps", "1", "--output-dir", str(out), "--seed", "1"] + TINY_FLAGS)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.startswith(f"tokencredit train: output_dir: {str(out)!r} already holds a run (config.json, metrics.jsonl, checkpoints)")
    assert "--resume" in err and "--overwrite" in err and "run.old-1" in err
    assert _tree(out) == before
    # --overwrite: the old run is moved aside whole, the new run starts from nothing
    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))
    code, err = _cli(["train", "--steps", "1", "--output-dir", str(out), "--seed", "1", "--overwrite"] + TINY_FLAGS)
    assert code == 0, err
    old = tmp_path / "run.old-1"
    assert {k: v[1] for k, v in _tree(old).items()} == {k: v[1] for k, v in before.items() if not k.startswith(".lock")}
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1.0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    # --resume with --overwrite: one line
    code, err = _cli(["train", "--steps", "2", "--output-dir", str(out), "--resume", "--overwrite"] + TINY_FLAGS)
    assert code == 2 and err.startswith("tokencredit train: overwrite: expected false with --resume")


# -- 21.2 the lock: a second run on the folder is refused, naming the holder ------------------


def test_a_folder_held_by_a_live_run_is_refused_naming_its_pid(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    # another process holds the folder (as a running `train` does): it says so, then waits on stdin
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tokencredit.train.runfolder import RunLock; held = RunLock(sys.argv[1]).acquire(); "
         "print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for cfg in (_cfg(out), _cfg(out, resume=True)):
            with pytest.raises(ConfigError) as ei:
                _trainer(cfg)
            assert str(ei.value) == (f"output_dir: {str(out)!r} is in use by another run (pid {holder.pid}); "
                                     f"wait for it to end, stop it, or choose another --output-dir")
    finally:
        holder.stdin.close()  # the holder exits; the kernel drops its lock
        holder.wait()
    _trainer(_cfg(out)).train()  # a dead holder's lock (and its stale pid file) is no obstacle
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1.0]


def test_the_lock_is_held_for_the_whole_run(tmp_path, monkeypatch):
    from tokencredit.train.runfolder import RunLock

    out = tmp_path / "run"
    tr = _trainer(_cfg(out, steps=2))
    seen = []
    real = tr.train_step

    def step():
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()}\)"):
            RunLock(out).acquire()
        seen.append(tr.step)
        return real()

    monkeypatch.setattr(tr, "train_step", step)
    tr.train()
    assert seen == [0, 1]
    RunLock(out).acquire().release()  # released when train() returns


# -- 21.3 a torn metrics line ------------------------------------------------------------------


def test_a_torn_metrics_line_is_repaired_on_resume_and_no_row_is_lost_or_doubled(tmp_path):
    from tokencredit.analysis.compare import read_metrics
    from tokencredit.train.runfolder import RunFolderWarning

    out = tmp_path / "run"
    _trainer(_cfg(out, steps=2)).train()
    m = out / "metrics.jsonl"
    m.write_bytes(m.read_bytes() + b'{"step": 3.0, "reward/me')  # a kill inside step 3's write
    # readers skip the torn tail with a warning
    with pytest.warns(RunFolderWarning, match=r"metrics.jsonl:3: a torn last line, skipped"):
        assert [r["step"] for r in read_metrics(m)] == [1, 2]
    with pytest.warns(RunFolderWarning, match="a torn last line .* was removed"):
        _trainer(_cfg(out, steps=3, resume=True)).train()
    assert [r["step"] for r in _lines(m)] == [1.0, 2.0, 3.0]


def test_resume_drops_the_rows_past_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    _trainer(_cfg(out, steps=3, save_every=2)).train()  # checkpoints 2 and 3
    shutil_rm = __import__("shutil").rmtree
    shutil_rm(out / "checkpoints" / "step_00000003")  # as if killed after step 3's row, before its checkpoint
    _trainer(_cfg(out, steps=4, save_every=2, resume=True)).train()
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1.0, 2.0, 3.0, 4.0]


# -- 21.4 SIGTERM ------------------------------------------------------------------------------


@pytest.fixture
def sigterm_fails_the_test():
    """SIGTERM outside the trainer's own handler fails the test instead of killing pytest."""
    import signal

    def fail(signum, frame):
        raise AssertionError("SIGTERM reached the default handler: the trainer does not handle it")

    prev = signal.signal(signal.SIGTERM, fail)
    yield
    signal.signal(signal.SIGTERM, prev)


@pytest.mark.parametrize("where", ["mid_step", "between_steps"])
def test_sigterm_writes_a_checkpoint_and_exits_143_saying_where_to_resume(tmp_path, tiny_cli, monkeypatch, sigterm_fails_the_test, where):
    import signal

    real_collect, real_step, calls = Trainer._collect, Trainer.train_step, {"n": 0}

    def collect(self):  # step 2, after its rollouts: the step finishes, then the checkpoint
        out = real_collect(self)
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGTERM)  # delivered to this thread, handled before it returns
        return out

    def step(self):  # before step 2 starts: the checkpoint of step 1 at once
        if self.step == 1:
            signal.raise_signal(signal.SIGTERM)
        return real_step(self)

    if where == "mid_step":
        monkeypatch.setattr(Trainer, "_collect", collect)
    else:
        monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code, err = _cli(["train", "--steps", "5", "--save-every", "100", "--output-dir", str(out)] + TINY_FLAGS)
    at = 2 if where == "mid_step" else 1
    assert code == 143
    assert err.strip().splitlines()[-1] == (f"train stopped by SIGTERM at step {at} of 5; continue with --resume "
                                            f"--output-dir {out}")
    ck = out / "checkpoints" / f"step_{at:08d}"
    assert (ck / "state.pt").exists() and str(ck) in printed.getvalue()
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [float(s) for s in range(1, at + 1)]
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the test's handler is back
    monkeypatch.undo()
    import tokencredit.engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))
    assert _cli(["train", "--steps", "3", "--save-every", "100", "--output-dir", str(out), "--resume"] + TINY_FLAGS)[0] == 0
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1.0, 2.0, 3.0]


# -- 21.5 a full disk --------------------------------------------------------------------------


@pytest.mark.parametrize("nth_fsync", [1, 2, 3, 4])
def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path, tiny_cli, monkeypatch, nth_fsync):
    """The nth fsync of the run (config.json, a metrics line, a checkpoint, ...) fails with
    ENOSPC, as a full disk makes it: one line, exit 1, no temporary file, whole lines only."""
    import errno

    real, calls = os.fsync, {"n": 0}

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] == nth_fsync:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "run"
    code, err = _cli(["train", "--steps", "3", "--output-dir", str(out)] + TINY_FLAGS)
    assert code == 1 and err.strip().count("\n") == 0, err
    assert err.startswith("tokencredit train: ") and "no space left on device writing" in err
    assert "Traceback" not in err
    left = [str(p.relative_to(out)) for p in out.rglob("*") if ".tmp" in p.name]
    assert left == []
    if (out / "metrics.jsonl").exists():
        _lines(out / "metrics.jsonl")  # whole lines only
    for ck in (out / "checkpoints").glob("step_*") if (out / "checkpoints").exists() else ():
        load_checkpoint(ck)  # every checkpoint left is whole


# -- 21.6 YAML bombs and deep nesting ----------------------------------------------------------


def _alias_bomb(levels: int, width: int, key="steps") -> str:
    """``key: [&a0 [1, ...], &a1 [*a0, ...], ...]``: each level repeats the one before ``width``
    times, so the value expands to width**levels numbers (the code before issue 21 built its
    repr for the error message: 10**6 took 13 s, 9**9 did not end within 60 s)."""
    items = [f"&a0 [{', '.join(['1'] * width)}]"]
    for i in range(1, levels):
        items.append(f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return f"{key}: [{', '.join(items)}]\n"


@pytest.mark.parametrize("doc,why", [
    (_alias_bomb(6, 10), "more than 10000 values once its aliases are expanded"),  # 10^6 values
    ("steps: " + "[" * 5000 + "1" + "]" * 5000 + "\n", "nesting deeper than 32 levels"),
    (_alias_bomb(9, 9), "more than 10000 values once its aliases are expanded"),  # 9^9: "billion laughs"
])
def test_yaml_alias_bombs_and_deep_nesting_are_one_line_before_any_repr(tmp_path, no_model_loading, doc, why):
    f = tmp_path / "bomb.yaml"
    f.write_text(doc)
    code, err = _cli(["train", "--config", str(f), "--output-dir", str(tmp_path / "r")])
    assert code == 2 and err.strip() == (f"tokencredit train: --config: {f}: expected a config of at most 10000 values "
                                         f"nested at most 32 levels, got {why}")
    with pytest.raises(ConfigError, match=r"^credit_args: taco.lam: expected a config of at most"):
        TrainConfig(credit="taco", credit_args=("taco.lam=" + "[" * 100 + "]" * 100,))


# -- 21.7 prompt + budget against the model's context ------------------------------------------


def test_a_budget_or_prompt_past_the_models_context_is_one_line_before_training(tmp_path):
    from tokencredit.engine.models import ModelError

    out = tmp_path / "run"
    with pytest.raises(ModelError) as ei:
        _trainer(dataclasses.replace(_cfg(out), rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=100000)))
    assert str(ei.value) == "rollout.max_new_tokens: expected < the model's context of 2048 tokens (max_position_embeddings of 'tiny'), got 100000"
    task = make_task("add1", n_train=4, n_eval=1)
    long = dataclasses.replace(task.train[2], messages=({"role": "user", "content": "7" * 2030},))
    task.train[2] = long
    model, tok = tiny_model_and_tokenizer(seed=0)
    with pytest.raises(ModelError) as ei:
        Trainer(_cfg(out), model=model, tokenizer=tok, task=task)
    text = tok.apply_chat_template(list(long.messages), tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert str(ei.value) == (
        f"task: expected prompts that leave room for rollout.max_new_tokens (4) in the model's context of 2048 tokens "
        f"('tiny'), got a prompt of {n} tokens (example {long.id!r}): {n + 4} > 2048; shorten the prompts or lower "
        f"rollout.max_new_tokens"
    )
    assert not out.exists()  # before training: nothing written


# -- 21.9 tracebacks that are one line now -----------------------------------------------------


def test_a_model_name_that_does_not_exist_is_one_line_without_retrying_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    asked = []

    def unreachable(name, **k):
        asked.append(name)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    out = str(tmp_path / "r")
    # a path that does not exist: at once, the Hub is not asked
    code, err = _cli(["train", "--model.name", "./no/such/model", "--output-dir", out])
    assert code == 2 and err.strip() == ("tokencredit train: model.name: expected a local model folder or a Hugging Face "
                                         "Hub id (org/name), got './no/such/model': no such folder")
    assert asked == []
    # a Hub-like id, not cached, Hub unreachable: asked once, one line
    code, err = _cli(["train", "--model.name", "my/model", "--output-dir", out])
    assert code == 2 and err.strip() == ("tokencredit train: model.name: 'my/model' is no local folder and not in the "
                                         "Hugging Face cache, and the Hub could not be reached (ConnectionError); check the "
                                         "name, or download the model first")
    assert asked == ["my/model"]
    # a folder that is no model
    (tmp_path / "empty").mkdir()
    code, err = _cli(["train", "--model.name", str(tmp_path / "empty"), "--output-dir", out])
    assert code == 2 and "expected a model folder with a config.json" in err and err.strip().count("\n") == 0


def test_a_model_without_a_chat_template_is_one_line_before_training(tmp_path, monkeypatch):
    import tokencredit.engine.models as models

    def no_template(name, **k):
        model, tok = tiny_model_and_tokenizer(seed=0)
        tok.chat_template = None
        return model, tok

    monkeypatch.setattr(models, "resolve_model", no_template)
    out = tmp_path / "r"
    code, err = _cli(["train", "--output-dir", str(out)] + TINY_FLAGS)
    assert code == 2 and err.strip() == (
        "tokencredit train: model.name: expected a chat model (a tokenizer with a chat template), got 'tiny', whose "
        "tokenizer has none; use an instruct/chat model, or set tokenizer.chat_template")
    assert not (out / "metrics.jsonl").exists()


def test_compare_report_only_on_a_damaged_run_folder_is_warnings_or_one_line(tmp_path):
    out = tmp_path / "cmp"
    run = out / "grpo" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(
        b'{"step": 1.0, "eval/greedy_acc": 0.5}\n\xff\xfe garbage\n{"step": "x"}\n[1, 2]\n{"step": 2.0, "eval/greedy_acc": 0.75}\n{"step": 3'
    )
    (out / "compare.json").write_text('{"specs": ["grpo"], "seeds": [0], "steps": 2}')
    code, err = _cli(["compare", "--report-only", "--output-dir", str(out)])
    assert code == 0, err
    said = [line for line in err.splitlines() if line.startswith("warning: ")]  # the command's one-line warnings
    assert any("metrics.jsonl:2: not a JSON object, skipped" in s for s in said), said
    assert any("metrics.jsonl:6: a torn last line, skipped" in s for s in said), said
    assert any("without a numeric step ('x')" in s for s in said), said
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["final_acc"]["values"] == [0.75] and summary[0]["steps_done"] == [2]
    (out / "compare.json").write_text('{"specs": ["grpo"], "se')  # damaged
    code, err = _cli(["compare", "--report-only", "--output-dir", str(out)])
    assert code == 2 and err.strip() == (f"tokencredit compare: {out / 'compare.json'}: expected the JSON compare writes, "
                                         f"got a damaged file (JSONDecodeError); give --credit and --seeds, or remove it")
    assert _cli(["compare", "--report-only", "--output-dir", str(out), "--credit", "grpo", "--seeds", "0"])[0] == 0
