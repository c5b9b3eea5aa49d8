"""``tokencredit compare``: runs per spec and seed, resumable, and a report that matches them."""

from __future__ import annotations

import json
import re
import statistics
import zlib
from pathlib import Path

import pytest

from tokencredit.analysis import compare
from tokencredit.analysis.compare import (
    load_results,
    parse_seeds,
    parse_specs,
    read_metrics,
    render_report,
    run_compare,
    run_dir_name,
    summarize,
)
from tokencredit.train.config import (
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer

SPECS = ["grpo", "grpo+taco"]
SEEDS = [0, 1]


def crc_reward(completion: str, example) -> float:
    """A deterministic reward that varies with the text, so that groups carry signal."""
    return float(zlib.crc32(completion.encode()) % 2)


def _base(steps=2, **kw) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=16, n_eval=2, reward_fn="test_compare:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=5, temperature=1.0),
        optim=OptimConfig(lr=1e-3, micro_batch_size=4),
        log=LogConfig(eval_every=kw.pop("eval_every", 1), eval_samples=1, progress=False),
        **kw,
    )


class Factory:
    """Builds a Trainer on the tiny random model (seeded by the run's seed); records configs."""

    def __init__(self, interrupt_at=None):
        self.configs = []
        self.interrupt_at = interrupt_at

    def __call__(self, cfg):
        self.configs.append(cfg)
        model, tok = tiny_model_and_tokenizer(seed=cfg.seed)
        tr = Trainer(cfg, model=model, tokenizer=tok)
        if self.interrupt_at is not None:
            real, calls = tr.train_step, {"n": 0}

            def step():
                calls["n"] += 1
                if calls["n"] == self.interrupt_at:
                    raise KeyboardInterrupt  # the trainer saves a checkpoint and returns
                return real()

            tr.train_step = step
        return tr


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    fac = Factory()
    result = run_compare(_base(), ",".join(SPECS), "0,1", out, trainer_factory=fac, progress=False)
    return out, result, fac


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _table(report: str):
    """spec -> {header: cell} from the report's Markdown summary table."""
    lines = [l for l in report.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for l in lines[2:]:
        cells = [c.strip() for c in l.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(header, cells))
    return rows


def _mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def test_every_run_exists_and_is_finished(compared):
    out, result, fac = compared
    assert result["runs"] == {(s, k): "started" for s in SPECS for k in SEEDS}
    assert len(fac.configs) == 4
    assert sorted((c.credit, c.seed) for c in fac.configs) == sorted((s, k) for s in SPECS for k in SEEDS)
    for spec in SPECS:
        for seed in SEEDS:
            run = out / spec / f"seed{seed}"  # '+' is kept in directory names
            rows = read_metrics(run / "metrics.jsonl")
            assert [int(r["step"]) for r in rows if r["step"] > 0] == [1, 2]
            assert (run / "checkpoints" / "step_00000002" / "state.pt").exists()
            assert json.loads((run / "config.json").read_text())["credit"] == spec
            assert json.loads((run / "config.json").read_text())["seed"] == seed


def test_report_table_matches_the_metrics_files(compared):
    out, result, _ = compared
    assert result["report"] == out / "report.md"
    table = _table((out / "report.md").read_text())
    assert set(table) == set(SPECS)
    for spec in SPECS:
        per_seed = [read_metrics(out / spec / f"seed{k}" / "metrics.jsonl") for k in SEEDS]
        final = [[r for r in rows if "eval/greedy_acc" in r][-1]["eval/greedy_acc"] for rows in per_seed]
        best = [max(r["eval/greedy_acc"] for r in rows if "eval/greedy_acc" in r and r["step"] > 0) for rows in per_seed]
        reward = [statistics.mean(r["reward"] for r in rows if "reward" in r) for rows in per_seed]
        gini = [statistics.mean(r["diag/weight_gini"] for r in rows if "diag/weight_gini" in r) for rows in per_seed]
        etr = [statistics.mean(r["diag/weight_etr"] for r in rows if "diag/weight_etr" in r) for rows in per_seed]
        sps = [statistics.mean(r["step_time"] for r in rows if "step_time" in r) for rows in per_seed]
        row = table[spec]
        for header, vals in [
            ("final greedy acc", final), ("best greedy acc", best), ("reward (run mean)", reward),
            ("weight Gini (run mean)", gini), ("effective-token ratio (run mean)", etr), ("s / step", sps),
        ]:
            m, s = _mean_std(vals)
            assert row[header] == f"{m:.3f} ± {s:.3f}", (spec, header)
        assert row["final acc min–max"] == f"{min(final):.3f}–{max(final):.3f}"
        assert row["seeds"] == "0,1" and row["steps"] == "2"
    # the machine-readable summary holds the unrounded per-seed values
    summary = {r["spec"]: r for r in json.loads((out / "summary.json").read_text())}
    for spec in SPECS:
        per_seed = [read_metrics(out / spec / f"seed{k}" / "metrics.jsonl") for k in SEEDS]
        assert summary[spec]["reward"]["values"] == pytest.approx(
            [statistics.mean(r["reward"] for r in rows if "reward" in r) for rows in per_seed], abs=1e-12
        )


def test_plots_are_valid_pngs(compared):
    import matplotlib.image as mpimg

    out, _, _ = compared
    report = (out / "report.md").read_text()
    for key, _label in compare.METRICS:
        png = out / "plots" / compare.metric_file_name(key)
        assert png.exists(), key
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img.reshape(-1, img.shape[-1]).std(axis=0).max() > 0.01  # not a blank canvas
        assert f"(plots/{png.name})" in report


def test_rerun_skips_finished_runs(compared, monkeypatch):
    out, _, _ = compared
    before = {p: _lines(p) for p in out.glob("*/seed*/metrics.jsonl")}
    assert len(before) == 4

    def boom(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(compare, "_default_trainer", boom)
    monkeypatch.setattr("tokencredit.train.trainer.Trainer", boom)
    result = run_compare(_base(), SPECS, SEEDS, out, progress=False)
    assert set(result["runs"].values()) == {"skipped"}
    assert {p: _lines(p) for p in out.glob("*/seed*/metrics.jsonl")} == before
    assert (out / "report.md").exists()


def test_interrupted_run_resumes_and_matches_a_straight_run(compared, tmp_path):
    straight_out, _, _ = compared
    out = tmp_path / "cmp"
    with pytest.raises(KeyboardInterrupt):
        run_compare(_base(steps=3), "grpo", "0", out, trainer_factory=Factory(interrupt_at=2), progress=False)
    run = out / "grpo" / "seed0"
    assert (run / "checkpoints" / "step_00000001").exists()
    assert not (out / "report.md").exists()
    # a row logged after the last checkpoint (then lost by a crash) and a torn line
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2.0, "reward": 99.0}) + "\n" + '{"step": 3.0, "rew')

    fac = Factory()
    result = run_compare(_base(steps=3), "grpo", "0", out, trainer_factory=fac, progress=False)
    assert result["runs"] == {("grpo", 0): "resumed"}
    assert len(fac.configs) == 1 and fac.configs[0].resume is True
    raw = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [int(r["step"]) for r in raw]
    assert steps == sorted(set(steps)) and steps[-3:] == [1, 2, 3]  # each step once, the stale row gone

    def strip(rows):
        return [{k: v for k, v in r.items() if not (k.startswith("time/") or k == "step_time")} for r in rows]

    # steps 1-2 of the resumed 3-step run are steps 1-2 of the straight 2-step run (eval every step)
    assert strip([r for r in raw if r["step"] <= 2]) == strip(read_metrics(straight_out / "grpo" / "seed0" / "metrics.jsonl"))
    assert _table((out / "report.md").read_text())["grpo"]["steps"] == "3"


def test_a_run_without_checkpoint_starts_over(tmp_path):
    out = tmp_path / "cmp"
    run = out / "grpo" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1.0, "reward": 99.0}) + "\n")
    fac = Factory()
    result = run_compare(_base(steps=2, eval_every=100), "grpo", "0", out, trainer_factory=fac, progress=False)
    assert result["runs"] == {("grpo", 0): "started"} and fac.configs[0].resume is False
    raw = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in raw if r["step"] > 0] == [1, 2]
    assert all(r.get("reward") != 99.0 for r in raw)


def test_a_run_of_another_configuration_is_an_error(compared, monkeypatch):
    out, _, _ = compared
    monkeypatch.setattr(compare, "_default_trainer", lambda cfg: pytest.fail("must not train"))
    base = _base()
    base.task.n_train = 17
    with pytest.raises(ValueError, match=r"task\.n_train: 16 -> 17"):
        run_compare(base, SPECS, SEEDS, out, progress=False)
    # a larger budget is the same experiment, continued (not checked here: it would train)


@pytest.mark.parametrize(
    "value,match",
    [("", "--credit"), (" , ", "--credit"), ("grpo,", "--credit: empty entry"), ("grpo,nope", "--credit: bad credit spec 'nope'"),
     ("taco+grpo", "--credit: bad credit spec 'taco\\+grpo'"), ("grpo,grpo", "--credit: 'grpo' and 'grpo'"),
     ("taco,grpo+taco", "same credit spec")],
)
def test_bad_specs_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        parse_specs(value)


@pytest.mark.parametrize("value", ["", "a", "0,-1", "0,0", "1.5", None, "0,,1"])
def test_bad_seeds_name_the_field(value):
    with pytest.raises(ValueError, match="--seeds"):
        parse_seeds(value)


def test_good_input_parses():
    assert parse_specs("grpo, taco ,oppo+stare,dapo") == ["grpo", "taco", "oppo+stare", "dapo"]
    assert parse_seeds("0, 2,1") == [0, 2, 1] and parse_seeds([3]) == [3]


def test_bad_output_dir_and_credit_args(tmp_path):
    with pytest.raises(ValueError, match="--output-dir"):
        run_compare(_base(), "grpo", "0", "", progress=False)
    with pytest.raises(ValueError, match=r"credit_args: overrides for \['stare'\]"):
        run_compare(_base(credit_args=("stare.P=0.2",)), "grpo,taco", "0", tmp_path, progress=False)


def test_credit_args_go_to_the_specs_that_use_them(tmp_path):
    base = _base(credit_args=("taco.lam=0.5",))
    assert compare.run_config(base, "grpo", 0, tmp_path).credit_args == ()
    cfg = compare.run_config(base, "rloo+taco", 3, tmp_path)
    assert cfg.credit_args == ("taco.lam=0.5",) and cfg.seed == 3 and cfg.output_dir == str(tmp_path / "rloo+taco" / "seed3")
    dapo = compare.run_config(base, "dapo", 0, tmp_path)
    assert dapo.credit == "grpo" and dapo.dapo.dynamic_sampling and dapo.output_dir.endswith("dapo/seed0")


def test_run_dir_names():
    assert run_dir_name("oppo+stare") == "oppo+stare"
    assert run_dir_name("dr_grpo") == "dr_grpo"
    assert run_dir_name("a/b c:..") == "a_b_c_.."
    assert run_dir_name("..") == "__"


def test_read_metrics_dedupes_sorts_and_skips_torn_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join([
        json.dumps({"step": 2.0, "a": 1.0}), json.dumps({"step": 1.0, "a": 5.0}), json.dumps({"step": 2.0, "a": 3.0}),
        json.dumps({"step": 3.0, "a": 4.0}), '{"step": 4',
    ]))
    assert read_metrics(p) == [{"step": 1.0, "a": 5.0}, {"step": 2.0, "a": 3.0}, {"step": 3.0, "a": 4.0}]
    assert [r["step"] for r in read_metrics(p, max_step=2)] == [1.0, 2.0]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_summary_and_report_of_synthetic_runs():
    def rows(accs, rewards):
        out = [{"step": 0.0, "eval/greedy_acc": 0.9}]  # a step-0 baseline is not a "best"
        for i, (a, r) in enumerate(zip(accs, rewards), 1):
            row = {"step": float(i), "reward": r, "step_time": 2.0}
            if a is not None:
                row["eval/greedy_acc"] = a
            out.append(row)
        return out

    results = {
        "grpo": {0: rows([None, 0.2, 0.1], [0.0, 0.5, 1.0]), 1: rows([None, 0.4, 0.3], [1.0, 1.0, 1.0])},
        "x+y": {0: rows([0.5, 0.6, 0.7], [0.0, 0.0, 0.0])},
    }
    table = {r.spec: r for r in summarize(results)}
    g = table["grpo"].stats
    assert g["final_acc"].values == [0.1, 0.3] and g["best_acc"].values == [0.2, 0.4]
    assert g["reward"].values == [0.5, 1.0]
    assert g["final_acc"].format() == f"0.200 ± {statistics.stdev([0.1, 0.3]):.3f}"
    assert table["x+y"].stats["final_acc"].format() == "0.700"  # one seed: no spread
    assert table["grpo"].stats["entropy"].format() == "–"  # not logged
    md = render_report(summarize(results), plots=[("mean reward", "plots/reward_mean.png")], meta={"task": "add1"})
    cells = _table(md)
    assert cells["grpo"]["final acc min–max"] == "0.100–0.300"
    assert cells["x+y"]["s / step"] == "2.000"
    assert "![mean reward](plots/reward_mean.png)" in md and "**task**: add1" in md
    steps, mean, lo, hi = compare.curve(results["grpo"], "eval/greedy_acc")
    assert steps == [0, 2, 3] and mean == pytest.approx([0.9, 0.3, 0.2]) and lo == [0.9, 0.2, 0.1] and hi == [0.9, 0.4, 0.3]


def test_load_results_ignores_missing_runs(compared, tmp_path):
    out, _, _ = compared
    res = load_results(out, SPECS + ["rloo"], [0, 1, 7])
    assert sorted(res["grpo"]) == [0, 1] and res["rloo"] == {}


def test_cli_compare(tmp_path, monkeypatch, capsys):
    from tokencredit.cli import main

    fac = Factory()
    monkeypatch.setattr(compare, "_default_trainer", fac)
    out = tmp_path / "cli"
    args = ["compare", "--credit", "grpo,rloo", "--seeds", "0", "--output-dir", str(out), "--steps", "1",
            "--task.name", "add1", "--task.n-train", "8", "--task.n-eval", "1", "--task.reward-fn", "test_compare:crc_reward",
            "--rollout.prompts-per-step", "2", "--rollout.samples-per-prompt", "2", "--rollout.max-new-tokens", "3",
            "--log.no-progress", "--quiet"]
    assert main(args) == 0
    assert [c.credit for c in fac.configs] == ["grpo", "rloo"] and fac.configs[0].steps == 1
    assert fac.configs[0].task.n_train == 8
    assert set(_table((out / "report.md").read_text())) == {"grpo", "rloo"}
    assert main(args) == 0 and len(fac.configs) == 2  # rerun: nothing trained
    assert main(["compare", "--output-dir", str(out), "--report-only"]) == 0
    for bad, field in [(["--credit", "grpo,zzz"], "--credit"), (["--credit", "grpo", "--seeds", "x"], "--seeds"),
                       (["--credit", "grpo", "--seed", "3"], "--seed")]:
        with pytest.raises(SystemExit, match=re.escape(field)):
            main(["compare", "--output-dir", str(out)] + bad)


class _NoTraining:
    """A trainer that builds nothing and reaches its last step at once; records the configs."""

    configs: list = []

    def __init__(self, cfg):
        self.cfg, self.step = cfg, 0
        self.configs.append(cfg)

    def train(self):
        self.step = self.cfg.steps


def test_compare_parses_each_spec_once(tmp_path, monkeypatch):
    """The command line, the runs' configs, the credit_args check and the report share one parse
    of each spec (a TrainConfig checking its own ``credit`` field when built is not compare's)."""
    import sys

    import tokencredit.credit.spec as spec_module
    from tokencredit.cli import main

    real, calls = spec_module.parse_spec, []

    def counting(spec):
        if sys._getframe(1).f_code.co_name != "check_fields":
            calls.append(spec)
        return real(spec)

    monkeypatch.setattr(spec_module, "parse_spec", counting)
    monkeypatch.setattr(compare, "_default_trainer", _NoTraining)
    monkeypatch.setattr(_NoTraining, "configs", [])
    out = tmp_path / "cli"
    assert main(["compare", "--credit", "grpo,rloo+taco,dapo", "--seeds", "0,1", "--output-dir", str(out), "--steps", "1",
                 "--credit-config.taco.lam", "0.5", "--quiet"]) == 0
    assert sorted(calls) == ["grpo", "grpo", "rloo+taco"]  # dapo is the recipe of grpo
    runs = sorted((Path(c.output_dir).parent.name, c.seed, c.credit, c.credit_config.taco.lam == 0.5) for c in _NoTraining.configs)
    assert runs == [("dapo", 0, "grpo", False), ("dapo", 1, "grpo", False), ("grpo", 0, "grpo", False), ("grpo", 1, "grpo", False),
                    ("rloo+taco", 0, "rloo+taco", True), ("rloo+taco", 1, "rloo+taco", True)]
    calls.clear()
    assert main(["compare", "--output-dir", str(out), "--report-only"]) == 0
    assert sorted(calls) == ["grpo", "grpo", "rloo+taco"]
