"""Method settings are typed config fields (issue 11, item 4).

``credit_config.METHOD.FIELD`` is each method's own config dataclass: on the command line
(``--credit-config.taco.lam 0.5``, listed by ``--help`` with its default and the source comment
of the method's file), in YAML (``credit_config: {taco: {lam: 0.5}}``) and from Python. The
``--credit-args taco.lam=0.5`` shorthand merges on top; one field set to two different values is
an error. Every bad name or value is a one-line ``ConfigError`` naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
import typing

import pytest
import yaml

from tokencredit import get_method
from tokencredit.cli import main
from tokencredit.train.config import (
    ConfigError,
    MethodConfigs,
    TrainConfig,
    _from_dict,
    config_diff,
    config_to_dict,
    load_config,
)

METHODS = [f.name for f in dataclasses.fields(MethodConfigs)]
METHOD_FIELDS = [
    (m, f.name, typing.get_type_hints(get_method(m).config_cls)[f.name], f)
    for m in METHODS
    for f in dataclasses.fields(get_method(m).config_cls)
]


def one_reward(completion: str, example) -> float:  # imported by name through task.reward_fn
    return float(len(completion) % 2)


def _cli(argv):
    """main(argv) -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_model_loading(monkeypatch):
    import tokencredit.engine.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(models, "resolve_model", boom)
    monkeypatch.setattr(models, "load_frozen", boom)


# -- --help lists every method setting, and every flag shows its own help ------------------------


def _help_entries():
    """``tokencredit train --help`` as {flag: help text} (the text joined into one line)."""
    code, out, _ = _cli(["train", "--help"])
    assert code == 0
    entries, flag = {}, None
    for raw in out.splitlines():
        line = raw[1:] if raw.startswith("│") else raw  # framed on a terminal, plain otherwise
        line = line.rstrip().rstrip("│").rstrip()
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if text.startswith("-") and set(text) != {"-"} and indent <= 2:
            # a flag line; a bool's "--x, --no-x" may wrap onto a second flag line
            if flag is None or entries[flag]:
                flag = text.split()[0].rstrip(",")
                entries[flag] = ""
        elif text and indent >= 5 and flag is not None:  # the flag's help, indented
            entries[flag] = (entries[flag] + " " + text).strip()
        else:  # a group's title, description or rule
            flag = None
    return entries


@pytest.fixture(scope="module")
def help_entries():
    return _help_entries()


def _own_text(text: str) -> str:
    return re.sub(r"\s*\(default:.*\)\s*$", "", text).strip()


def test_every_method_setting_is_a_flag_with_its_default_and_help(help_entries):
    assert len(METHOD_FIELDS) > 50  # every built-in method with settings is here
    for m, name, tp, f in METHOD_FIELDS:
        flag = f"--credit-config.{m.replace('_', '-')}.{name.replace('_', '-')}"
        assert flag in help_entries, flag
        text = help_entries[flag]
        assert _own_text(text), f"{flag} has no help text"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if default is None or isinstance(default, (bool, int, float)):
            assert f"(default: {default})" in text, (flag, text)
        else:
            assert "(default: " in text, (flag, text)


def test_every_train_option_shows_its_own_help(help_entries):
    """The comment of one field never shows under another (tyro repeats a comment block over the
    uncommented fields after it: --steps, --seed and --output-dir once showed credit_args')."""
    own = {k: _own_text(v) for k, v in help_entries.items() if not k.startswith(("--credit-config.", "-h"))}
    assert len(own) > 50
    assert not [k for k, v in own.items() if not v], "options without help"
    seen = {}
    for k, v in own.items():
        assert v not in seen, f"{k} shows the help of {seen[v]}: {v!r}"
        seen[v] = k


def test_within_a_method_each_setting_has_its_own_help(help_entries):
    known: set = set()
    for m in METHODS:
        prefix = f"--credit-config.{m.replace('_', '-')}."
        texts = {k: _own_text(v) for k, v in help_entries.items() if k.startswith(prefix) and k not in known}
        doubles = [k for k, v in texts.items() if list(texts.values()).count(v) > 1]
        assert not doubles, doubles


# -- the three ways to set a method field are the same setting -----------------------------------


def _yaml(tmp_path, doc) -> str:
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(doc))
    return str(f)


def test_flag_yaml_shorthand_and_python_give_the_same_method_configs(tmp_path):
    spec = ["--credit", "grpo+taco"]
    by_flag = load_config(None, spec + ["--credit-config.taco.lam", "0.5", "--credit-config.grpo.no-std-normalize"])
    by_yaml = load_config(_yaml(tmp_path, {"credit": "grpo+taco", "credit_config": {"taco": {"lam": 0.5}, "grpo": {"std_normalize": False}}}))
    by_args = load_config(None, spec + ["--credit-args", "taco.lam=0.5", "grpo.std_normalize=false"])
    by_python = TrainConfig(credit="grpo+taco", credit_config={"taco": {"lam": 0.5}, "grpo": {"std_normalize": False}})
    want = {"grpo": get_method("grpo").config_cls(std_normalize=False), "taco": get_method("taco").config_cls(lam=0.5)}
    for cfg in (by_flag, by_yaml, by_args, by_python):
        assert cfg.validate().method_configs() == want
    # the command line wins over the YAML file, field by field
    both = load_config(_yaml(tmp_path, {"credit": "grpo+taco", "credit_config": {"taco": {"lam": 0.5, "alpha": 0.02}}}),
                       ["--credit-config.taco.lam", "0.7"])
    assert (both.credit_config.taco.lam, both.credit_config.taco.alpha) == (0.7, 0.02)


def test_the_shorthand_merges_on_top_and_one_field_set_twice_differently_is_an_error():
    cfg = TrainConfig(credit="grpo+taco", credit_config={"taco": {"lam": 0.5}}, credit_args=("taco.alpha=0.02",))
    taco = cfg.method_configs()["taco"]
    assert (taco.lam, taco.alpha) == (0.5, 0.02)
    same = TrainConfig(credit="grpo+taco", credit_config={"taco": {"lam": 0.5}}, credit_args=("taco.lam=0.5",))
    assert same.method_configs()["taco"].lam == 0.5
    clash = TrainConfig(credit="grpo+taco", credit_config={"taco": {"lam": 0.5}}, credit_args=("taco.lam=0.6",))
    with pytest.raises(ConfigError, match=r"^credit_args: taco\.lam=0\.6 and credit_config\.taco\.lam=0\.5 .*one place$"):
        clash.validate()


def test_only_the_methods_of_the_spec_may_be_set_and_the_trainer_gets_them(no_model_loading, tmp_path):
    cfg = TrainConfig(credit="grpo", credit_config={"taco": {"lam": 0.5}}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^credit_config\.taco: set, but taco is not in the credit spec 'grpo' \(its methods: grpo\)$"):
        cfg.validate()
    code, _, err = _cli(["train", "--output-dir", str(tmp_path / "run"), "--credit-config.stare.P", "0.2"])
    assert code == 2 and err.strip() == "tokencredit train: credit_config.stare: set, but stare is not in the credit spec 'grpo' (its methods: grpo)"
    assert not (tmp_path / "run").exists()
    # a method of the spec at a value equal to its default is no setting at all
    assert TrainConfig(credit="grpo", credit_config={"taco": {"lam": 0.9}}).validate()


def test_the_trainer_runs_with_the_merged_configs(tmp_path):
    from tokencredit.testing import tiny_model_and_tokenizer
    from tokencredit.train.trainer import Trainer

    cfg = TrainConfig(credit="grpo+taco", output_dir=str(tmp_path / "run"), credit_config={"taco": {"lam": 0.5}},
                      credit_args=("taco.alpha=0.02",))
    cfg.model.name, cfg.task.n_train, cfg.task.n_eval = "tiny", 8, 2
    model, tok = tiny_model_and_tokenizer(seed=0)
    tr = Trainer(cfg, model=model, tokenizer=tok)
    assert (tr.credit.configs["taco"].lam, tr.credit.configs["taco"].alpha) == (0.5, 0.02)


# -- unknown names: one line naming them and the valid choices -----------------------------------


@pytest.mark.parametrize("flag,named,choices", [
    ("--credit-config.tacoo.lam", "'tacoo'", ["'taco'", "'stare'", "'acpo'"]),
    ("--credit-config.taco.lamm", "--credit-config.taco.lamm", ["'lam'", "'alpha'", "'mode'"]),
    ("--credit-config.stare.h-target", "--credit-config.stare.h-target", ["'H_target'", "'P'"]),
])
def test_an_unknown_method_or_field_on_the_command_line_is_one_line_with_the_choices(no_model_loading, tmp_path, flag, named, choices):
    code, _, err = _cli(["train", "--output-dir", str(tmp_path / "run"), flag, "0.5"])
    assert code == 2 and err.count("\n") == 1 and err.startswith("tokencredit train: --credit-config."), err
    assert named in err and all(c in err for c in choices), err


@pytest.mark.parametrize("doc,where,choices", [
    ({"tacoo": {"lam": 0.5}}, "credit_config: unknown key(s) ['tacoo']", ["'taco'", "'stare'"]),
    ({"taco": {"lamm": 0.5}}, "credit_config.taco: unknown key(s) ['lamm']", ["'lam'", "'alpha'"]),
])
def test_an_unknown_method_or_field_in_yaml_is_one_line_with_the_choices(tmp_path, doc, where, choices):
    with pytest.raises(ConfigError) as ei:
        load_config(_yaml(tmp_path, {"credit": "grpo+taco", "credit_config": doc}))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(where) and all(c in msg for c in choices), msg


@pytest.mark.parametrize("args,start", [
    (("nope.x=1",), "credit_args: unknown credit method 'nope'; registered: ["),
    (("taco.lamm=1",), "credit_args: taco.lamm: unknown field of taco; expected one of ['alpha', 'lam'"),
    (("stare.P=0.2",), "credit_args: stare.P: stare is not in the credit spec 'grpo+taco'"),
    (("taco.lam=abc",), "credit_args: taco.lam: expected a number, got 'abc'"),
    (("taco.lam=2",), "credit_args: taco.lam: expected a number in [0, 1], got 2"),
])
def test_the_shorthand_names_what_is_wrong(args, start):
    with pytest.raises(ConfigError) as ei:
        TrainConfig(credit="grpo+taco", credit_args=args).validate()
    assert str(ei.value).startswith(start) and "\n" not in str(ei.value), str(ei.value)


# -- every method field is checked: its type here, its range by the method ------------------------


def _wrong_type(tp):
    """Values of another type than ``tp`` (the test's own notion, independent of the library's)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        return [0.9, ["a", "b"], [0.1, 0.2, 0.3], [True, 0.9]]
    return {
        int: ["three", 1.5, True, [1]],
        float: ["x", True, [0.5], float("nan")],  # inf is allowed: several methods' "off"
        bool: [1, 0, "yes", 1.0],
        str: [3, 1.5, True, ["a"], ""],
    }[tp]


CASES = [(f"{m}.{name}", v) for m, name, tp, _ in METHOD_FIELDS for v in _wrong_type(tp)]


@pytest.mark.parametrize("path,value", CASES, ids=[f"{p}={v!r}" for p, v in CASES])
def test_a_method_field_of_the_wrong_type_is_a_one_line_error_naming_it(tmp_path, path, value):
    m, name = path.split(".")
    # from YAML
    with pytest.raises(ConfigError) as ei:
        load_config(_yaml(tmp_path, {"credit_config": {m: {name: value}}}))
    msg = str(ei.value)
    assert msg.startswith(f"credit_config.{m}.{name}: expected ") and "\n" not in msg, msg
    # set on a built config (no __post_init__ runs): validate finds it
    cfg = TrainConfig(credit=m if get_method(m).kind == "estimator" else f"grpo+{m}")
    object.__setattr__(getattr(cfg.credit_config, m), name, value)
    with pytest.raises(ConfigError, match=rf"^credit_config\.{m}\.{name}: expected "):
        cfg.validate()


@pytest.mark.parametrize("flag,value,msg", [
    ("--credit-config.taco.lam", "2", "credit_config.taco.lam: expected a number in [0, 1], got 2.0"),
    ("--credit-config.stare.P", "0", "credit_config.stare.P: expected a fraction in (0, 1], got 0.0"),
    ("--credit-config.gae.whiten-eps", "-1", "credit_config.gae.whiten_eps: expected a number > 0, got -1.0"),
])
def test_a_method_field_out_of_range_on_the_command_line_names_it(no_model_loading, tmp_path, flag, value, msg):
    code, _, err = _cli(["train", "--output-dir", str(tmp_path / "run"), flag, value])
    assert code == 2 and err.strip() == f"tokencredit train: {msg}", err


def test_a_method_field_out_of_range_set_after_construction_is_found_by_validate():
    cfg = TrainConfig(credit="grpo+taco")
    object.__setattr__(cfg.credit_config.taco, "lam", 1.5)  # no __post_init__ ran
    with pytest.raises(ConfigError, match=r"^credit_config\.taco\.lam: expected a number in \[0, 1\], got 1\.5$"):
        cfg.validate()


# -- config.json -----------------------------------------------------------------------------------


def test_config_json_holds_the_settings_of_the_spec_methods_and_reads_back():
    cfg = TrainConfig(credit="grpo+taco", credit_config={"taco": {"lam": 0.5}}, credit_args=("taco.alpha=0.02",))
    d = json.loads(json.dumps(config_to_dict(cfg)))
    assert sorted(d["credit_config"]) == ["grpo", "taco"]  # only the spec's methods
    assert (d["credit_config"]["taco"]["lam"], d["credit_config"]["taco"]["alpha"]) == (0.5, 0.02)  # as run
    back = _from_dict(TrainConfig, d, "config.json")
    assert back.method_configs() == cfg.method_configs()
    assert json.loads(json.dumps(config_to_dict(back))) == d
    assert config_diff(d, json.loads(json.dumps(config_to_dict(back)))) == []
    # every field, one through each type (a tuple, None, inf)
    pact = TrainConfig(credit="pact", credit_config={"pact": {"reward_range": [-1, 1]}})
    d = json.loads(json.dumps(config_to_dict(pact)))
    assert _from_dict(TrainConfig, d, "config.json").method_configs() == pact.method_configs()
    arca = TrainConfig(credit="grpo+arca")
    d = json.loads(json.dumps(config_to_dict(arca)))
    assert _from_dict(TrainConfig, d, "config.json").method_configs()["arca"].w_max == float("inf")


def test_a_config_json_written_before_credit_config_resumes_and_a_changed_setting_is_found():
    new = json.loads(json.dumps(config_to_dict(TrainConfig(credit="grpo+taco"))))
    old = {k: v for k, v in new.items() if k != "credit_config"}  # the methods at their defaults
    assert config_diff(old, new) == [] and config_diff(new, old) == []
    changed = json.loads(json.dumps(config_to_dict(TrainConfig(credit="grpo+taco", credit_config={"taco": {"lam": 0.5}}))))
    assert config_diff(old, changed) == ["credit_config.taco.lam: 0.9 -> 0.5"]
    # a dict with every method at its defaults (dataclasses.asdict) is the same config
    assert config_diff(dataclasses.asdict(TrainConfig(credit="grpo+taco")), new) == []


def test_train_with_a_method_flag_writes_it_to_config_json_and_resumes(tmp_path, monkeypatch):
    import tokencredit.engine.models as models
    from tokencredit.testing import tiny_model_and_tokenizer

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))
    out = tmp_path / "run"
    flags = shlex.split(
        f"--credit taco --credit-config.taco.lam 0.5 --output-dir {out} --steps 1 --model.name tiny --task.name add1 "
        "--task.n-train 8 --task.n-eval 2 --task.reward-fn test_config_methods:one_reward --rollout.prompts-per-step 2 "
        "--rollout.samples-per-prompt 2 --rollout.max-new-tokens 4 --log.eval-samples 1 --log.no-progress "
        "--log.no-eval-at-start --log.no-save-rollouts"
    )
    code, _, err = _cli(["train"] + flags)
    assert code == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["credit_config"]["taco"]["lam"] == 0.5 and sorted(saved["credit_config"]) == ["grpo", "taco"]
    code, _, err = _cli(["train"] + flags + ["--steps", "2", "--resume"])
    assert code == 0, err
    code, _, err = _cli(["train"] + flags + ["--steps", "3", "--resume", "--credit-config.taco.lam", "0.6"])
    assert code == 2 and "credit_config.taco.lam: 0.5 -> 0.6" in err, err



def test_credit_config_for_keeps_only_the_settings_of_one_spec():
    from tokencredit.train.config import credit_config_for

    base = TrainConfig(credit_config={"taco": {"lam": 0.5}, "stare": {"P": 0.2}}).credit_config
    only_taco = credit_config_for(base, "grpo+taco")
    assert (only_taco.taco.lam, only_taco.stare.P) == (0.5, 0.1)
    assert TrainConfig(credit="grpo+taco", credit_config=only_taco).validate()
    assert credit_config_for(base, "dapo").stare.P == 0.1  # a recipe: its spec (grpo)


def test_compare_gives_each_run_its_own_methods_settings(tmp_path):
    from tokencredit.analysis.compare import _check_credit_args, run_config
    from tokencredit.train.config import load_config

    base = load_config(None, ["--credit", "grpo+taco", "--credit-config.taco.lam", "0.5"])
    taco = run_config(base, "grpo+taco", 0, tmp_path / "a")
    grpo = run_config(base, "grpo", 0, tmp_path / "b")
    assert taco.method_configs()["taco"].lam == 0.5
    assert set(grpo.method_configs()) == {"grpo"}  # the taco setting does not reach the grpo run
    grpo.validate()
    _check_credit_args((), ["grpo", "grpo+taco"], base.credit_config)
    with pytest.raises(ValueError, match=r"credit_config: settings for \['taco'\]"):
        _check_credit_args((), ["grpo", "rloo"], base.credit_config)
