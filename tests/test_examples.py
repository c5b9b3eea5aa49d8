"""The examples run: the own-trainer YAML for own data (examples/own_data/train.yaml) through the
command line, and the TRL user script (examples/trl_own_data.py), each on the tiny model."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_own_data_yaml_trains(tmp_path, monkeypatch):
    import tokencredit.engine.models as models
    from tokencredit.cli import main
    from tokencredit.testing import tiny_model_and_tokenizer

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0, eos_bias=3.0))
    monkeypatch.chdir(EXAMPLES / "own_data")  # my_rewards.py is found next to the data, as for a user
    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--config", "train.yaml", "--steps", "1", "--output-dir", str(out), "--rollout.max-new-tokens", "6",
                     "--task.n-eval", "2", "--log.eval-samples", "0", "--log.no-eval-at-start", "--log.no-progress"])
    assert code == 0, err.getvalue()[-2000:]
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/correct/mean" in row and row["rewards/brevity/mean"] < 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["optim"]["lr"] == 2e-6 and cfg["credit"] == "grpo+taco"


def test_the_trl_user_script_trains(tmp_path):
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("trl_own_data", EXAMPLES / "trl_own_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tr = mod.main(["--model", "tiny", "--output-dir", str(tmp_path / "trl"), "--max-steps", "1", "--max-completion-length", "6"])
    logged = [h for h in tr.state.log_history if "rewards/correct/mean" in h]
    assert logged and logged[0]["rewards/brevity/mean"] < 0
    assert (tmp_path / "trl" / "eval" / "rollouts_step_00000001.pt").is_file()  # inspect reads it
