"""Compare credit specs on the same task, model, seeds and budget; write a report.

    tokencredit compare --credit grpo,taco,stare --seeds 0,1 --output-dir runs/compare --steps 20

One resumable run per spec and seed lives in ``<out>/<spec>/seed<k>/`` (an ordinary
``tokencredit train`` run directory). Rerunning the command skips finished runs (those whose
``metrics.jsonl`` has the final step) and resumes unfinished ones from their latest checkpoint.
Afterwards ``<out>/report.md`` holds a summary table and ``<out>/plots/*.png`` one figure per
metric with every spec on it (mean over seeds, shaded min-max over seeds).

One job in two parts, kept in one module (just past ~600 lines) because both read
:class:`CompareSpec` and the run-directory layout:

* pure parts, testable without training: :func:`parse_specs`, :func:`parse_seeds`,
  :func:`run_dir_name`, :func:`read_metrics`, :func:`load_results`, :func:`summarize`,
  :func:`curve`, :func:`render_report`, :func:`plot_curves`, :func:`write_report`;
* the running part: :func:`run_compare` (and :func:`run_one`), which builds a
  :class:`~tokencredit.train.trainer.Trainer` per run through an injectable ``trainer_factory``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "METRICS",
    "SummaryRow",
    "CompareSpec",
    "parse_specs",
    "parse_seeds",
    "run_dir_name",
    "read_metrics",
    "is_finished",
    "load_results",
    "summarize",
    "curve",
    "render_report",
    "plot_curves",
    "write_report",
    "run_one",
    "run_compare",
]

#: (metrics.jsonl key, label) of every curve plotted and summarised
METRICS: Tuple[Tuple[str, str], ...] = (
    ("eval/greedy_acc", "eval greedy accuracy"),
    ("reward", "mean reward"),
    ("entropy", "entropy"),
    ("completions/mean_length", "response length"),
    ("diag/weight_gini", "weight Gini"),
    ("diag/weight_etr", "effective-token ratio"),
    ("step_time", "seconds per step"),
)
#: a metric's name in runs written before TRL's names (read as the new one when that is missing)
_OLD_NAMES = {"reward/mean": "reward", "entropy/mean": "entropy", "response/len_mean": "completions/mean_length",
              "time/step_s": "step_time", "lr": "learning_rate", "loss/policy": "loss"}


# ---------------------------------------------------------------------------------------
# input


class CompareSpec(str):
    """One entry of ``--credit`` as the user wrote it (a spec or a recipe name), parsed once:
    ``credit`` is the spec it stands for, ``methods`` its methods' names, which the rest of a
    ``compare`` call reads instead of parsing the spec again."""

    credit: str
    methods: Tuple[str, ...]

    def __new__(cls, text: str) -> "CompareSpec":
        from ..train.config import RECIPES
        from ..credit.spec import parse_spec

        self = super().__new__(cls, text)
        self.credit = RECIPES[text]["credit"] if text in RECIPES else text
        self.methods = tuple(m.name for m in parse_spec(self.credit))
        return self


def _parsed(spec: str) -> CompareSpec:
    """``spec`` as a :class:`CompareSpec`: as given when it is one, parsed otherwise."""
    return spec if isinstance(spec, CompareSpec) else CompareSpec(spec)


def parse_specs(value: Any, field_name: str = "--credit") -> List[CompareSpec]:
    """``"grpo,taco,oppo+stare"`` (or a list) -> validated specs or recipe names, each parsed once
    (a :class:`CompareSpec`; one given is not parsed again).

    Raises ValueError naming ``field_name`` for an empty list, an unknown method, a malformed
    spec, or the same spec given twice (also under two spellings, ``taco`` and ``grpo+taco``).
    """
    from ..train.config import RECIPES

    items = value.split(",") if isinstance(value, str) else list(value or [])
    texts = [s if isinstance(s, CompareSpec) else str(s).strip() for s in items]
    if not texts or all(not s for s in texts):
        raise ValueError(f"{field_name}: expected a comma-separated list of credit specs (e.g. grpo,taco), got {value!r}")
    if any(not s for s in texts):
        raise ValueError(f"{field_name}: empty entry in {value!r}")
    specs: List[CompareSpec] = []
    seen: Dict[str, str] = {}
    dirs: Dict[str, str] = {}
    for s in texts:
        try:
            spec = _parsed(s)
        except (KeyError, ValueError) as e:
            msg = e.args[0] if e.args else str(e)
            raise ValueError(f"{field_name}: bad credit spec {s!r}: {msg}") from None
        canon = f"recipe:{s}" if s in RECIPES else "+".join(spec.methods)
        if canon in seen:
            raise ValueError(f"{field_name}: {seen[canon]!r} and {s!r} are the same credit spec ({canon}); give it once")
        d = run_dir_name(s)
        if d in dirs:
            raise ValueError(f"{field_name}: specs {dirs[d]!r} and {s!r} map to the same directory name {d!r}")
        seen[canon] = dirs[d] = s
        specs.append(spec)
    return specs


def parse_seeds(value: Any, field_name: str = "--seeds") -> List[int]:
    """``"0,1,2"`` (or a list of ints) -> distinct non-negative seeds."""
    items = value.split(",") if isinstance(value, str) else list(value if value is not None else [])
    seeds: List[int] = []
    for raw in items:
        s = str(raw).strip()
        if isinstance(raw, bool) or not re.fullmatch(r"\d+", s):
            raise ValueError(f"{field_name}: expected non-negative integers separated by commas (e.g. 0,1), got {value!r}")
        seeds.append(int(s))
    if not seeds:
        raise ValueError(f"{field_name}: expected at least one seed (e.g. 0,1), got {value!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{field_name}: seed given twice in {value!r}")
    return seeds


def run_dir_name(spec: str) -> str:
    """The directory name of a spec: letters, digits, ``_ + - .`` kept, anything else -> ``_``."""
    name = re.sub(r"[^A-Za-z0-9_+.\-]", "_", spec.strip())
    if name in ("", ".", ".."):
        name = name.replace(".", "_") or "_"
    return name


def run_path(output_dir: Path, spec: str, seed: int) -> Path:
    return Path(output_dir) / run_dir_name(spec) / f"seed{seed}"


# ---------------------------------------------------------------------------------------
# reading runs (pure)


def read_metrics(path: Path, max_step: Optional[int] = None) -> List[Dict[str, float]]:
    """The rows of a ``metrics.jsonl``, sorted by step, one per step (a step logged twice --
    by a run written before resumes dropped the rows past their checkpoint -- keeps its last
    row). Rows past ``max_step`` are dropped; a line that is not a JSON object (a torn last
    line of a killed process, damage) or has no numeric step is skipped with a
    :class:`~tokencredit.train.runfolder.RunFolderWarning` naming it. Missing file -> ``[]``."""
    import warnings

    from ..train.runfolder import RunFolderWarning
    from ..train.runfolder import read_metrics as read_rows

    by_step: Dict[int, Dict[str, float]] = {}
    for row in read_rows(path):
        step = row.get("step")
        if not _finite(step):
            warnings.warn(f"{path}: a row without a numeric step ({str(step)[:40]!r}) skipped", RunFolderWarning, stacklevel=2)
            continue
        step = int(step)
        if max_step is not None and step > max_step:
            continue
        for old, new in _OLD_NAMES.items():
            if old in row and new not in row:
                row[new] = row.pop(old)
        by_step[step] = row
    return [by_step[s] for s in sorted(by_step)]


def _check_runs_folder(output_dir: Path) -> None:
    """A ValueError naming ``output_dir`` unless it is a folder (a report of runs that are not there)."""
    p = Path(output_dir)
    if not p.is_dir():
        raise ValueError(f"--output-dir: expected a folder of compare runs, got {str(p)!r}: "
                         f"{'a file' if p.exists() else 'no such folder'}")


def read_meta(output_dir: Path) -> Dict[str, Any]:
    """``<out>/compare.json`` (the specs, seeds and steps a compare ran), ``{}`` when there is
    none; a damaged one is a ValueError naming it."""
    _check_runs_folder(output_dir)
    f = Path(output_dir) / "compare.json"
    if not f.exists():
        return {}
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: expected the JSON compare writes, got a damaged file ({type(e).__name__}); "
                         f"give --credit and --seeds, or remove it") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(meta).__name__}; give --credit and --seeds, or remove it")
    return meta


def is_finished(run_dir: Path, steps: int) -> bool:
    """A run is finished when its metrics.jsonl has the final step."""
    return any(int(r["step"]) == steps for r in read_metrics(Path(run_dir) / "metrics.jsonl"))


def load_results(output_dir: Path, specs: Sequence[str], seeds: Sequence[int], steps: Optional[int] = None) -> Dict[str, Dict[int, List[Dict[str, float]]]]:
    """``{spec: {seed: rows}}`` read from ``<out>/<spec>/seed<k>/metrics.jsonl`` (runs that
    do not exist yet have no entry)."""
    out: Dict[str, Dict[int, List[Dict[str, float]]]] = {}
    for spec in specs:
        out[spec] = {}
        for seed in seeds:
            rows = read_metrics(run_path(output_dir, spec, seed) / "metrics.jsonl", max_step=steps)
            if rows:
                out[spec][seed] = rows
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def _values(rows: Sequence[Dict[str, float]], key: str) -> List[float]:
    return [float(r[key]) for r in rows if _finite(r.get(key))]


@dataclass
class Stat:
    """One number per seed, summarised over seeds."""

    values: List[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else float("nan")

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (0 for a single seed)."""
        if len(self.values) < 2:
            return 0.0 if self.values else float("nan")
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (len(self.values) - 1))

    @property
    def min(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def max(self) -> float:
        return max(self.values) if self.values else float("nan")

    def format(self, digits: int = 3) -> str:
        if not self.values:
            return "–"
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"


@dataclass
class SummaryRow:
    spec: str
    seeds: List[int]
    steps_done: List[int]  # last step logged, per seed
    stats: Dict[str, Stat]  # column key -> per-seed values


#: summary columns: (key, header, how a seed's rows become one number)
COLUMNS: Tuple[Tuple[str, str], ...] = (
    ("final_acc", "final greedy acc"),
    ("best_acc", "best greedy acc"),
    ("reward", "reward (run mean)"),
    ("entropy", "entropy (run mean)"),
    ("length", "response length (run mean)"),
    ("gini", "weight Gini (run mean)"),
    ("etr", "effective-token ratio (run mean)"),
    ("sec_per_step", "s / step"),
)

_RUN_MEAN_KEYS = {
    "reward": "reward",
    "entropy": "entropy",
    "length": "completions/mean_length",
    "gini": "diag/weight_gini",
    "etr": "diag/weight_etr",
    "sec_per_step": "step_time",
}


def _seed_numbers(rows: Sequence[Dict[str, float]]) -> Dict[str, Optional[float]]:
    acc = [(int(r["step"]), float(r["eval/greedy_acc"])) for r in rows if _finite(r.get("eval/greedy_acc"))]
    out: Dict[str, Optional[float]] = {
        "final_acc": acc[-1][1] if acc else None,
        # best over evaluations after training steps: a step-0 baseline eval is not a result
        "best_acc": max((a for s, a in acc if s > 0), default=None),
    }
    for col, key in _RUN_MEAN_KEYS.items():
        v = _values(rows, key)
        out[col] = sum(v) / len(v) if v else None
    return out


def summarize(results: Dict[str, Dict[int, List[Dict[str, float]]]]) -> List[SummaryRow]:
    """One :class:`SummaryRow` per spec: final and best eval greedy accuracy (the last and the
    best eval of each seed), and the run mean of reward, entropy, response length, weight Gini,
    effective-token ratio and seconds per step, each as per-seed values."""
    table = []
    for spec, by_seed in results.items():
        stats = {col: Stat() for col, _ in COLUMNS}
        seeds = sorted(by_seed)
        for seed in seeds:
            for col, v in _seed_numbers(by_seed[seed]).items():
                if v is not None:
                    stats[col].values.append(v)
        table.append(SummaryRow(spec=spec, seeds=seeds, steps_done=[int(by_seed[s][-1]["step"]) for s in seeds], stats=stats))
    return table


def curve(by_seed: Dict[int, List[Dict[str, float]]], key: str) -> Tuple[List[int], List[float], List[float], List[float]]:
    """(steps, mean, min, max) over seeds of metric ``key`` at each step some seed logged it."""
    per_step: Dict[int, List[float]] = {}
    for rows in by_seed.values():
        for r in rows:
            if _finite(r.get(key)):
                per_step.setdefault(int(r["step"]), []).append(float(r[key]))
    steps = sorted(per_step)
    return (
        steps,
        [sum(per_step[s]) / len(per_step[s]) for s in steps],
        [min(per_step[s]) for s in steps],
        [max(per_step[s]) for s in steps],
    )


def metric_file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_") + ".png"


# ---------------------------------------------------------------------------------------
# report (pure)


def render_report(
    table: Sequence[SummaryRow],
    *,
    plots: Sequence[Tuple[str, str]] = (),
    meta: Optional[Dict[str, Any]] = None,
    digits: int = 3,
) -> str:
    """The Markdown report: a summary table (mean ± sample std over seeds, and the min–max
    range of final accuracy) and links to the plots (``(label, relative path)``)."""
    meta = dict(meta or {})
    lines = ["# tokencredit compare", ""]
    if meta:
        for k, v in meta.items():
            lines.append(f"- **{k}**: {v}")
        lines.append("")
    lines += [
        "Each cell is the mean ± sample standard deviation over seeds of one number per seed "
        "(final / best: the last and the best eval after a training step of each run; run mean: the mean over the run's "
        "logged steps). `–`: not logged.",
        "",
    ]
    header = ["spec", "seeds", "steps"] + [h for _, h in COLUMNS] + ["final acc min–max"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|")
    for row in table:
        fa = row.stats["final_acc"]
        rng = f"{fa.min:.{digits}f}–{fa.max:.{digits}f}" if fa.n else "–"
        steps = ",".join(str(s) for s in sorted(set(row.steps_done))) or "–"
        cells = [f"`{row.spec}`", ",".join(str(s) for s in row.seeds) or "–", steps]
        cells += [row.stats[col].format(digits) for col, _ in COLUMNS]
        cells.append(rng)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if plots:
        lines += ["## Curves", "", "Mean over seeds; the shaded band is the min–max range over seeds.", ""]
        for label, rel in plots:
            lines += [f"### {label}", "", f"![{label}]({rel})", ""]
    return "\n".join(lines)


def plot_curves(results: Dict[str, Dict[int, List[Dict[str, float]]]], plot_dir: Path, metrics: Sequence[Tuple[str, str]] = METRICS) -> List[Tuple[str, Path]]:
    """One PNG per metric with every spec on it; returns ``[(label, path)]`` of the figures
    written (a metric no run logged gets no figure)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label in metrics:
        curves = {spec: curve(by_seed, key) for spec, by_seed in results.items()}
        if not any(c[0] for c in curves.values()):
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        for spec, (steps, mean, lo, hi) in curves.items():
            if not steps:
                continue
            (line,) = ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, ms=3, label=spec)
            if any(a != b for a, b in zip(lo, hi)):
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{label} ({key})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plot_dir / metric_file_name(key)
        fig.savefig(path, format="png")
        plt.close(fig)
        written.append((label, path))
    return written


def write_report(output_dir: Path, specs: Sequence[str], seeds: Sequence[int], *, steps: Optional[int] = None, meta: Optional[Dict[str, Any]] = None) -> Path:
    """Read every run under ``output_dir``, write ``report.md``, ``summary.json`` and
    ``plots/*.png``; returns the report's path."""
    output_dir = Path(output_dir)
    _check_runs_folder(output_dir)
    results = load_results(output_dir, specs, seeds, steps)
    table = summarize(results)
    plots = plot_curves(results, output_dir / "plots")
    rel = [(label, p.relative_to(output_dir).as_posix()) for label, p in plots]
    report = output_dir / "report.md"
    report.write_text(render_report(table, plots=rel, meta=meta))
    summary = [
        {
            "spec": r.spec,
            "seeds": r.seeds,
            "steps_done": r.steps_done,
            **{col: {"values": s.values, "mean": s.mean if s.n else None, "std": s.std if s.n else None} for col, s in r.stats.items()},
        }
        for r in table
    ]
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return report


# ---------------------------------------------------------------------------------------
# running


def _default_trainer(cfg):
    from ..train.trainer import Trainer

    return Trainer(cfg)


def _filter_credit_args(credit_args: Iterable[str], spec: str) -> Tuple[str, ...]:
    """The ``method.field=value`` overrides that concern ``spec``'s methods."""
    names = set(_parsed(spec).methods)
    return tuple(a for a in credit_args if a.split("=", 1)[0].split(".", 1)[0] in names)


def _check_credit_args(credit_args: Sequence[str], specs: Sequence[str], credit_config=None) -> None:
    from ..train.config import configured_methods, parse_credit_args

    used = {name for s in specs for name in _parsed(s).methods}
    unknown = sorted(set(parse_credit_args(credit_args)) - used)
    if unknown:
        raise ValueError(f"credit_args: overrides for {unknown}, which no spec of {list(specs)} uses")
    unknown = sorted(set(configured_methods(credit_config)) - used) if credit_config is not None else []
    if unknown:
        raise ValueError(f"credit_config: settings for {unknown}, which no spec of {list(specs)} uses")


def run_config(base, spec: str, seed: int, output_dir: Path):
    """The TrainConfig of one run: ``base`` with this spec, seed and directory; the
    ``credit_config`` settings of methods outside the spec are back at their defaults."""
    from ..train.config import apply_recipe

    spec = _parsed(spec)
    section = base.credit_config
    own = {f.name for f in dataclasses.fields(section)} & set(spec.methods)
    cfg = dataclasses.replace(
        copy.deepcopy(base),  # runs share no nested config object
        credit=str(spec),
        seed=seed,
        output_dir=str(run_path(output_dir, spec, seed)),
        credit_args=_filter_credit_args(base.credit_args, spec),
        credit_config=copy.deepcopy(type(section)(**{n: getattr(section, n) for n in own})),
        resume=False,
    )
    return apply_recipe(cfg)


def check_run_config(run_dir: Path, cfg) -> None:
    """Raise ValueError if ``run_dir`` holds a run of another experiment than ``cfg`` (fields
    other than the budget and bookkeeping, ``config.SAFE_TO_CHANGE``, differ), so that a report
    never mixes the two. The same comparison refuses a ``--resume`` with changed settings."""
    from ..train.config import config_diff, config_to_dict
    from ..train.runfolder import RunFolder

    saved = RunFolder(run_dir).saved_config()
    if saved is None:  # none, or not JSON
        return
    diffs = config_diff(saved, json.loads(json.dumps(config_to_dict(cfg))))
    if diffs:
        raise ValueError(
            f"{run_dir}: an existing run with a different configuration ({'; '.join(diffs[:5])}); "
            f"use another --output-dir or delete that run"
        )


def _prepare_resume(run_dir: Path, cfg) -> Optional[int]:
    """The checkpoint step an existing, unfinished run resumes from, or None when it has no
    checkpoint (it starts again; the trainer moves the old files aside). On resume the
    trainer drops the metrics rows past the checkpoint, so no step is logged twice."""
    from ..train.runfolder import RunFolder

    steps = RunFolder(run_dir).steps()
    return steps[-1] if steps else None


def run_one(cfg, trainer_factory: Optional[Callable] = None, log: Callable[[str], None] = print) -> str:
    """Train one run to ``cfg.steps``: ``"skipped"`` if finished, ``"resumed"`` or
    ``"started"`` otherwise. Raises KeyboardInterrupt if the trainer was interrupted, and
    ValueError if the directory holds a run with another configuration."""
    trainer_factory = trainer_factory or _default_trainer
    run_dir = Path(cfg.output_dir)
    check_run_config(run_dir, cfg)
    if is_finished(run_dir, cfg.steps):
        return "skipped"
    status = "started"
    if run_dir.exists():
        from ..train.runfolder import holds_run

        step = _prepare_resume(run_dir, cfg)
        if step is not None:
            cfg = dataclasses.replace(cfg, resume=True)
            status = "resumed"
            log(f"  resuming from step {step}")
        elif holds_run(run_dir):  # interrupted before its first checkpoint: start again
            cfg = dataclasses.replace(cfg, overwrite=True)
    trainer = trainer_factory(cfg)
    trainer.train()
    if trainer.step < cfg.steps:  # the trainer caught Ctrl-C and saved a checkpoint
        raise KeyboardInterrupt(f"{run_dir} interrupted at step {trainer.step}")
    return status


def run_compare(
    base,
    specs: Sequence[str] | str,
    seeds: Sequence[int] | str,
    output_dir: str | Path,
    *,
    trainer_factory: Optional[Callable] = None,
    progress: bool = True,
    report: bool = True,
) -> Dict[str, Any]:
    """Run every (spec, seed) with ``base``'s task, model and budget, then write the report.

    ``base`` is a :class:`~tokencredit.train.config.TrainConfig`; its ``credit``, ``seed``,
    ``output_dir`` and ``resume`` are set per run, and ``credit_args`` are passed to the runs
    whose spec has the method. ``trainer_factory(cfg)`` builds the trainer (tests inject a tiny
    model). Returns ``{"runs": {(spec, seed): status}, "report": path}``.
    """
    from rich.console import Console

    specs = parse_specs(specs)
    seeds = parse_seeds(seeds)
    if not isinstance(output_dir, (str, Path)) or not str(output_dir).strip():
        raise ValueError(f"--output-dir: expected a directory, got {output_dir!r}")
    _check_credit_args(base.credit_args, specs, base.credit_config)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True, quiet=not progress, highlight=False)
    jobs = [(spec, seed) for spec in specs for seed in seeds]
    configs = {(spec, seed): run_config(base, spec, seed, out) for spec, seed in jobs}
    for job in jobs:  # before training anything: a mismatch is found at once, not hours later
        check_run_config(Path(configs[job].output_dir), configs[job])
    statuses: Dict[Tuple[str, int], str] = {}
    (out / "compare.json").write_text(json.dumps({"specs": specs, "seeds": seeds, "steps": base.steps}, indent=2))
    for i, (spec, seed) in enumerate(jobs, 1):
        cfg = configs[(spec, seed)]
        if is_finished(Path(cfg.output_dir), cfg.steps):
            statuses[(spec, seed)] = "skipped"  # run_one would skip it too; said here once
            console.print(f"[{i}/{len(jobs)}] {spec} seed {seed}: finished, skipped")
            continue
        console.print(f"[{i}/{len(jobs)}] {spec} seed {seed}: training {cfg.steps} steps in {cfg.output_dir}")
        statuses[(spec, seed)] = run_one(cfg, trainer_factory, log=console.print)
    path = None
    if report:
        cfg0 = configs[jobs[0]]
        meta = {
            "task": cfg0.task.name,
            "model": cfg0.model.name,
            "steps": base.steps,
            "seeds": ",".join(map(str, seeds)),
            "rollout": f"{cfg0.rollout.prompts_per_step} prompts x {cfg0.rollout.samples_per_prompt} samples, "
                       f"max {cfg0.rollout.max_new_tokens} new tokens, T={cfg0.rollout.temperature}",
            "eval every": f"{cfg0.log.eval_every} steps (and the last)",
        }
        path = write_report(out, specs, seeds, steps=base.steps, meta=meta)
        console.print(f"report written to {path}")
    return {"runs": statuses, "report": path}
