"""Issue 29, findings 4, 5, 9 and 11 (in part): the run folder's lock, a user's data files,
``eval``'s rows, and one line where a traceback or a quiet surprise was.

Each test failed on the code before issue 29 (each was run against it once); the tiny random
model (tokencredit.testing) keeps them to seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tokencredit.cli import main
from tokencredit.testing import tiny_model_and_tokenizer

HERE = Path(__file__).resolve().parent


def crc_reward(completion: str, example) -> float:
    return float(zlib.crc32(completion.encode()) % 2)


TINY_FLAGS = shlex.split(
    "--model.name tiny --task.name add1 --task.n-train 16 --task.n-eval 2 "
    "--task.reward-fn test_reliability4:crc_reward --rollout.prompts-per-step 2 --rollout.samples-per-prompt 2 "
    "--rollout.max-new-tokens 4 --optim.micro-batch-size 4 --log.eval-samples 1 --log.no-progress "
    "--log.no-eval-at-start --save-every 1"
)


@pytest.fixture
def tiny_cli(monkeypatch):
    """The command line with the tiny model in place of the named one."""
    import tokencredit.engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test: errors must come before."""
    import tokencredit.engine.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(models, "resolve_model", boom)
    monkeypatch.setattr(models, "load_frozen", boom)


def _cli(argv):
    """main(argv) -> (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _one_line(code, err, start: str) -> str:
    """The single line of a user error (exit 2) that starts with ``start``."""
    assert code == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(start), lines[0]
    return lines[0]


def _steps(out: Path):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE)] + sys.path))


# == 4. the run folder's lock survives `rm .lock` ============================================

# A `train` in a child process, with the tiny model, that stops before the step it is told and
# waits for a line on stdin (so the test can act while it holds the folder).
_PAUSED_TRAIN = r"""
import sys
import tokencredit.engine.models as models
from tokencredit.testing import tiny_model_and_tokenizer
models.resolve_model = lambda name, **k: tiny_model_and_tokenizer(seed=0)
from tokencredit.train.trainer import Trainer
pause_at = int(sys.argv[1])
real = Trainer.train_step
def step(self):
    if self.step == pause_at:
        print("paused", flush=True)
        sys.stdin.readline()
    return real(self)
Trainer.train_step = step
from tokencredit.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _paused_train(pause_at: int, argv):
    child = subprocess.Popen([sys.executable, "-c", _PAUSED_TRAIN, str(pause_at)] + argv, env=_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = []
    for line in child.stdout:  # "resumed from ...", then "paused"
        said.append(line)
        if line.strip() == "paused":
            return child
    child.kill()
    raise AssertionError(f"the child run did not reach its pause: {said} {child.stderr.read()[-3000:]}")


def test_a_second_resume_is_refused_after_the_lock_file_is_deleted(tmp_path, tiny_cli, monkeypatch):
    out = tmp_path / "run"
    flags = ["--output-dir", str(out)] + TINY_FLAGS
    assert _cli(["train", "--steps", "2"] + flags)[0] == 0
    first = _paused_train(2, ["train", "--resume", "--steps", "4"] + flags)  # holds the folder, before step 3
    try:
        for name in (".lock", ".lock.pid"):  # "stale" lock files, deleted by hand
            (out / name).unlink()
        import tokencredit.engine.models as models

        monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
        code, err = _cli(["train", "--resume", "--steps", "4"] + flags)
        assert _one_line(code, err, "tokencredit train: ") == (
            f"tokencredit train: output_dir: {str(out)!r} is in use by another run (pid {first.pid}); "
            f"wait for it to end, stop it, or choose another --output-dir")
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(timeout=120) == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert _steps(out) == [1.0, 2.0, 3.0, 4.0]  # each step once, none interleaved
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


def test_a_live_processs_temporary_checkpoint_is_never_pruned(tmp_path):
    import torch

    from tokencredit.train.checkpoint import save_checkpoint
    from tokencredit.train.runfolder import process_tag

    root = tmp_path / "checkpoints"
    root.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead_pid = int(dead.stdout)
        names = {
            "live": f".tmp_step_00000003_{process_tag(live.pid)}",  # another run writing its checkpoint
            "dead": f".tmp_step_00000003_{dead_pid}-1",  # a killed run's leftover
            "reused": f".tmp_step_00000004_{live.pid}-1",  # a dead writer whose pid is in use again
        }
        for name in names.values():
            (root / name).mkdir()
            (root / name / "state.pt").write_bytes(b"half")
        save_checkpoint(root, 2, {"x": torch.ones(2)})
        assert sorted(p.name for p in root.iterdir()) == sorted([names["live"], "step_00000002"])
    finally:
        live.stdin.close()
        live.wait()


# == 5. a user's data files: one format per folder; a changed file refuses --resume =========

DATA_FLAGS = shlex.split(
    "--model.name tiny --task.n-train 16 --task.n-eval 2 --rollout.prompts-per-step 2 --rollout.samples-per-prompt 2 "
    "--rollout.max-new-tokens 4 --optim.micro-batch-size 4 --log.eval-samples 1 --log.no-progress "
    "--log.no-eval-at-start --save-every 1 --data.eval-fraction 0.2"
)


def _write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _qa(n: int, start: int = 0):
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(start, start + n)]


def test_a_data_folder_of_mixed_formats_is_refused_naming_the_files(tmp_path, no_model_loading):
    import pandas as pd

    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "a.jsonl", _qa(20))
    pd.DataFrame(_qa(5, 100)).to_parquet(data / "b.parquet")
    code, err = _cli(["train", "--data.path", str(data), "--output-dir", str(tmp_path / "run"), "--steps", "1"] + DATA_FLAGS)
    assert _one_line(code, err, "tokencredit train: ") == (
        f"tokencredit train: data.path: expected the files of one format in the folder {str(data)!r}, got a.jsonl (json), "
        f"b.parquet (parquet); keep one format there, or name one file")
    assert not (tmp_path / "run").exists()


def test_resume_on_a_changed_data_file_is_refused_like_a_changed_setting(tmp_path, tiny_cli, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    _write_jsonl(rows, _qa(10))
    out = tmp_path / "run"
    flags = ["--data.path", str(rows), "--output-dir", str(out)] + DATA_FLAGS
    assert _cli(["train", "--steps", "1"] + flags)[0] == 0
    assert _cli(["train", "--steps", "2", "--resume"] + flags)[0] == 0  # the same file resumes
    before = rows.read_bytes()
    _write_jsonl(rows, _qa(10, 50))  # replaced at the same path
    import tokencredit.engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    code, err = _cli(["train", "--steps", "3", "--resume"] + flags)
    line = _one_line(code, err, f"tokencredit train: resume: the run in {str(out)!r} was trained on other data: ")
    assert f"data.path {str(rows)!r} changed (sha256 " in line and "train in a new output_dir" in line, line
    assert _steps(out) == [1.0, 2.0]
    rows.write_bytes(before)  # the file it trained on again: resumes
    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))
    assert _cli(["train", "--steps", "3", "--resume"] + flags)[0] == 0
    assert _steps(out) == [1.0, 2.0, 3.0]


# == 9. eval scores the whole file it is given, says how many rows, takes a LoRA export ======

EVAL_FLAGS = shlex.split(
    "--model.name tiny --rollout.max-new-tokens 4 --log.eval-samples 0 --log.no-progress"
)


def _eval(capsys, argv):
    """`tokencredit eval ...` -> (exit code, its JSON output, its stderr)."""
    code, err = _cli(["eval"] + argv)
    out = capsys.readouterr().out
    return code, (json.loads(out[out.index("{"):]) if code == 0 else None), err


def _samples(folder: Path):
    (f,) = (folder / "eval").glob("samples_step_*.jsonl")
    return [json.loads(line) for line in f.read_text().splitlines()]


def test_eval_scores_every_row_of_the_given_file_and_says_how_many(tmp_path, tiny_cli, capsys):
    rows = tmp_path / "rows.jsonl"
    _write_jsonl(rows, _qa(6))
    code, metrics, err = _eval(capsys, ["--data.path", str(rows), "--output-dir", str(tmp_path / "e1")] + EVAL_FLAGS)
    assert code == 0, err
    assert metrics["eval/rows"] == 6 and len(_samples(tmp_path / "e1")) == 6  # not a 10% hold-out of 1 row
    assert f"eval: scoring all 6 rows of {str(rows)!r}" in err.splitlines()
    big = tmp_path / "eval.jsonl"
    _write_jsonl(big, _qa(40, 10))
    flags = ["--data.path", str(rows), "--data.eval-path", str(big)] + EVAL_FLAGS
    code, metrics, err = _eval(capsys, flags + ["--output-dir", str(tmp_path / "e2")])
    assert code == 0, err
    assert metrics["eval/rows"] == 40 and len(_samples(tmp_path / "e2")) == 40  # not task.n_eval's 32
    assert f"eval: scoring all 40 rows of {str(big)!r}" in err.splitlines()
    code, metrics, err = _eval(capsys, flags + ["--task.n-eval", "5", "--output-dir", str(tmp_path / "e3")])
    assert code == 0, err
    assert metrics["eval/rows"] == 5 and len(_samples(tmp_path / "e3")) == 5  # a cap the user asked for, said
    assert f"eval: scoring 5 of 40 rows of {str(big)!r} (task.n_eval 5)" in err.splitlines()


def test_eval_of_a_run_says_how_many_rows_it_scored(tmp_path, tiny_cli, capsys):
    run = tmp_path / "run"
    builtin = [f for f in TINY_FLAGS if f != "--task.reward-fn" and not f.endswith(":crc_reward")]  # no user code to trust
    assert _cli(["train", "--steps", "1", "--output-dir", str(run)] + builtin)[0] == 0
    capsys.readouterr()
    code, metrics, err = _eval(capsys, ["--run", str(run)])
    assert code == 0, err
    assert metrics["eval/rows"] == 2
    assert "eval: scoring 2 rows of task 'add1' (task.n_eval 2)" in err.splitlines()
    assert json.loads((tmp_path / "run-eval" / "eval_step_00000001.json").read_text())["eval/rows"] == 2


@pytest.fixture(scope="module")
def lora_export(tmp_path_factory):
    """A LoRA run's export (a peft adapter folder over a base model folder), and the base."""
    from tokencredit.train.config import (
        LogConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )
    from tokencredit.train.export import export_run
    from tokencredit.train.trainer import Trainer

    d = tmp_path_factory.mktemp("lora")
    model, tok = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(d / "base")
    tok.save_pretrained(d / "base")
    cfg = TrainConfig(
        credit="grpo", steps=2, save_every=1, output_dir=str(d / "run"),
        model=ModelConfig(name=str(d / "base"), lora=True, lora_r=2, lora_alpha=4),
        task=TaskConfig(name="add1", n_train=8, n_eval=1, reward_fn="test_reliability4:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=6, temperature=1.0),
        optim=OptimConfig(lr=5e-2, micro_batch_size=4),
        log=LogConfig(eval_every=100, eval_samples=0, progress=False, eval_at_start=False, save_rollouts=False),
    )
    Trainer(cfg).train()
    return Path(export_run(str(d / "run"), str(d / "adapter"))), d / "base", d / "run"


def test_eval_takes_a_lora_export_folder_that_from_pretrained_loads(tmp_path, lora_export, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from tokencredit.engine.models import is_lora, resolve_model

    adapter, base, run = lora_export
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    model, _ = resolve_model(str(adapter))
    assert is_lora(model)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    want = AutoModelForCausalLM.from_pretrained(adapter)(ids).logits  # what from_pretrained loads
    assert torch.allclose(model(ids).logits, want)
    assert not torch.allclose(AutoModelForCausalLM.from_pretrained(base)(ids).logits, want)  # the adapter is in it
    code, metrics, err = _eval(capsys, ["--model.name", str(adapter), "--task.name", "add1", "--task.n-eval", "2",
                                        "--output-dir", str(tmp_path / "e"), "--rollout.max-new-tokens", "4",
                                        "--log.eval-samples", "0", "--log.no-progress"])
    assert code == 0, err
    assert metrics["eval/rows"] == 2


# == 11. one line where a traceback or a quiet surprise was ==================================


def test_device_cuda_without_cuda_is_one_line_before_the_model_loads(tmp_path, no_model_loading, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, on any machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    out = tmp_path / "run"
    code, err = _cli(["train", "--device", "cuda", "--output-dir", str(out)] + TINY_FLAGS)
    assert _one_line(code, err, "tokencredit train: device: ") == (
        f"tokencredit train: device: expected auto or cpu (this torch {torch.__version__} sees no CUDA device), got 'cuda'")
    assert not out.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU: cuda:1 is not there
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, err = _cli(["train", "--device", "cuda:1", "--output-dir", str(out)] + TINY_FLAGS)
    assert _one_line(code, err, "tokencredit train: device: ") == (
        "tokencredit train: device: expected auto, cpu, cuda or cuda:0 (1 CUDA device), got 'cuda:1'")


def test_a_reward_timeout_too_large_to_wait_for_is_one_line_at_validation(tmp_path, no_model_loading):
    out = tmp_path / "run"
    code, err = _cli(["train", "--task.reward-timeout-s", "1e300", "--output-dir", str(out)] + TINY_FLAGS)
    assert _one_line(code, err, "tokencredit train: ") == (
        "tokencredit train: task.reward_timeout_s: expected a finite number > 0 and <= 86400, got 1e+300")
    assert not out.exists()  # nothing that would need --overwrite


@pytest.mark.parametrize("cut", ["header", "half", "end"])
def test_a_truncated_model_safetensors_is_one_line_naming_the_file(tmp_path, cut):
    model, tok = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: {"header": 100, "half": len(data) // 2, "end": len(data) - 10}[cut]])
    code, err = _cli(["train", "--model.name", str(tmp_path / "m"), "--output-dir", str(tmp_path / "run")] + TINY_FLAGS[2:])
    line = _one_line(code, err, f"tokencredit train: model.name: expected whole safetensors files in {str(tmp_path / 'm')!r}, "
                                f"got {str(f)!r}, damaged or truncated (")
    assert "SafetensorError" in line, line


def test_overwrite_under_a_read_only_parent_is_one_line(tmp_path, tiny_cli, monkeypatch):
    import errno
    import pathlib

    out = tmp_path / "run"
    assert _cli(["train", "--steps", "1", "--output-dir", str(out)] + TINY_FLAGS)[0] == 0
    real = pathlib.Path.mkdir

    def read_only(self, *a, **k):  # the parent refuses new entries (root ignores chmod, so it is simulated)
        if self.parent == tmp_path and not self.exists():
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    import tokencredit.engine.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    code, err = _cli(["train", "--steps", "1", "--overwrite", "--output-dir", str(out)] + TINY_FLAGS)
    assert _one_line(code, err, "tokencredit train: ") == (
        f"tokencredit train: overwrite: expected to move the old run aside into {str(tmp_path / 'run.old-1')!r}, got "
        f"PermissionError (Permission denied); make {str(tmp_path)!r} writable, or choose another --output-dir")
    assert _steps(out) == [1.0]  # the old run is where it was


def test_a_yaml_key_given_twice_is_refused_naming_it(tmp_path, no_model_loading):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: 5\nrollout:\n  temperature: 0.7\n  max_new_tokens: 8\n  temperature: 1.0\n")
    code, err = _cli(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "run")] + TINY_FLAGS)
    assert _one_line(code, err, "tokencredit train: ") == (
        f"tokencredit train: --config: {cfg}: key 'rollout.temperature' given twice (lines 3 and 5); keep one")
    from tokencredit.train.config import load_yaml_bounded

    # a merge key overriding is no duplicate
    assert load_yaml_bounded("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n", "t")["b"] == {"x": 3, "y": 2}


def test_a_duplicate_csv_column_is_refused_naming_it(tmp_path, no_model_loading):
    data = tmp_path / "rows.csv"
    data.write_text("prompt,answer,prompt\nWhat is 1 + 1?,2,ignored\nWhat is 2 + 1?,3,ignored\n")
    code, err = _cli(["train", "--data.path", str(data), "--output-dir", str(tmp_path / "run")] + DATA_FLAGS)
    assert _one_line(code, err, "tokencredit train: ") == (
        f"tokencredit train: data.path: expected distinct column names in {str(data)!r}, got 'prompt' twice "
        f"(columns 1 and 3); rename one")


def inf_logging_reward(completions, log_metric, **kwargs):
    log_metric("big", float("inf"))
    return [float(len(c) % 2) for c in completions]


def test_log_metric_of_inf_writes_null_not_infinity_and_says_so(tmp_path, tiny_cli):
    out = tmp_path / "run"
    flags = [f for f in TINY_FLAGS if f != "--task.reward-fn" and not f.endswith(":crc_reward")]  # reward.funcs instead
    code, err = _cli(["train", "--steps", "1", "--output-dir", str(out), "--reward.funcs",
                      "test_reliability4:inf_logging_reward"] + flags)
    assert code == 0, err

    def strict(c):
        raise ValueError(f"not JSON: {c}")

    rows = [json.loads(line, parse_constant=strict) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rewards/extra/big"] is None
    assert "warning: metrics.jsonl: rewards/extra/big is inf, not a JSON number; written as null" in err.splitlines()


def test_compare_report_only_on_a_missing_folder_names_the_folder(tmp_path):
    missing = tmp_path / "nothing-here"
    for extra in ([], ["--credit", "grpo", "--seeds", "0"]):
        code, err = _cli(["compare", "--report-only", "--output-dir", str(missing)] + extra)
        assert _one_line(code, err, "tokencredit compare: ") == (
            f"tokencredit compare: --output-dir: expected a folder of compare runs, got {str(missing)!r}: no such folder")
        assert not missing.exists()
