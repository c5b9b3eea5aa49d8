"""``tokencredit bench``: does credit matter? Credit specs x seeds on controlled tasks, with the
true credit (``oracle``) as the ceiling.

    tokencredit bench                       # the default suite: 3 tasks x DEFAULT_SPECS x 10 seeds
    tokencredit bench --quick               # 3 tasks x grpo,oracle x 2 seeds, a few steps (< 5 min)
    tokencredit bench --tasks keytok --credit grpo,oracle,rloo --seeds 0,1,2 --output-dir runs/bench
    tokencredit bench --policy lora --credit grpo,oracle,grpo+arca --output-dir runs/bench-lora

Built on :mod:`tokencredit.analysis.compare`: every (task, spec, seed) is an ordinary run directory
``<out>/<task>/<spec>/seed<k>/`` trained by the own trainer (:class:`BenchTrainer`, a
:class:`~tokencredit.train.trainer.Trainer` whose eval adds the policy's exact success rate), skipped
when finished and resumed from its checkpoint when interrupted (``compare.run_one``). The tasks
are :mod:`tokencredit.data.controlled`'s; each seed's initial policy (:mod:`tokencredit.analysis.bench_policy`)
is built once and cached under ``<out>/init/``, so every spec of a seed starts from the same
weights and sees the same prompt order (paired seeds). Runs go to ``workers`` processes.

Measures per task and spec, over seeds (:func:`summarize_task`): the exact success curve
(``bench/success``: the mean over the eval questions of V(h_0), the policy's success
probability, by enumeration: no sampling noise), its area (AUC: trapezoid over the eval steps,
divided by the step range), the final success, the greedy accuracy, the steps to a success
threshold, the AUC's paired difference to GRPO and the headroom recovered
``(AUC_spec - AUC_grpo) / (AUC_oracle - AUC_grpo)``, each with a paired bootstrap interval over
seeds, and the smallest difference in AUC the seeds can detect.

The LoRA setting (``policy="lora"``, ``--policy lora``): the same cached policy of each (task,
seed), wrapped by :func:`tokencredit.engine.models.add_lora` with the adapter of :data:`LORA`
(drawn from the seed, so every spec of a seed starts from the same adapter); only the adapter
trains (the base weights and the frozen logit bias stay as built), at the learning rate
``LORA.lr``. Every spec of such a bench trains through the same adapter, so grpo and oracle are
the baseline and ceiling of an adapter method (ARCA, which reads the adapter's effect and is
refused in the full-weight setting). Its runs live in ``<out>/<task>-lora/`` (:func:`task_dir`),
and a bench directory holds one setting (``bench.json`` records it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import BenchError  # noqa: F401 (defined in errors; importable here too)

__all__ = [
    "SUITE", "DEFAULT_SPECS", "QUICK_SPECS", "TaskSettings", "SETTINGS", "BenchError", "BenchTrainer",
    "POLICIES", "LoraSettings", "LORA", "parse_policy", "task_settings", "task_dir",
    "parse_tasks", "bench_config", "kept_steps", "KEPT_DIR", "kept_path", "save_kept", "kept_weights", "load_kept", "run_bench", "summarize_task", "bootstrap", "write_bench_report", "oracle_separation",
]

SUITE = ("keytok", "carry", "fork")
#: the two ends of the headroom (grpo, oracle), a group baseline (rloo), a critic (pact) and a
#: calibrator (grpo+taco): what 10 seeds x 3 tasks fit in an hour on 2 shared cores. Any other
#: registered spec the tiny policies can train is given with --credit (not ARCA: it needs LoRA)
DEFAULT_SPECS = ("grpo", "oracle", "rloo", "pact", "grpo+taco")
QUICK_SPECS = ("grpo", "oracle")
DEFAULT_SEEDS = tuple(range(10))
QUICK_SEEDS = (0, 1)
#: bootstrap resamples and the interval's coverage
N_BOOT = 2000
COVERAGE = 0.95


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """The fixed training settings of one task (chosen before the runs, on grpo and oracle)."""

    steps: int
    lr: float
    eval_every: int
    threshold: float  # the success rate "steps to threshold" waits for
    keep_every: int = 10  # the policy's weights are kept at every multiple of it (step 0 included): KEPT_DIR
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0


SETTINGS: Dict[str, TaskSettings] = {
    "keytok": TaskSettings(steps=40, lr=3e-3, eval_every=5, threshold=0.5),
    "carry": TaskSettings(steps=40, lr=3e-3, eval_every=5, threshold=0.5),
    "fork": TaskSettings(steps=40, lr=3e-3, eval_every=5, threshold=0.5),
}
QUICK_STEPS = 6

#: the bench's policy settings: ``full`` trains every weight (SETTINGS); ``lora`` trains a LoRA
#: adapter on the same policy (LORA), every spec through the same adapter
POLICIES = ("full", "lora")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The LoRA setting of the bench (fixed before its runs). The adapter: rank ``r``, scale
    ``alpha / r`` (peft), on every projection of the 2 Llama blocks (attention and MLP); the
    embeddings and the LM head (its frozen -1e4 bias outside the alphabet included) are not
    adapted and do not train. ``lr``: the AdamW learning rate of the adapter on every task, chosen
    on grpo and oracle only (one seed, before any other spec ran: docs/benchmark.md); the other
    settings are the task's (SETTINGS)."""

    r: int = 8
    alpha: int = 16
    targets: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lr: float = 3e-3  # pilot (seed 0, grpo+oracle mean AUC over the 3 tasks): 1e-3 0.245, 3e-3 0.274, 1e-2 0.235, 3e-2 0.190


LORA = LoraSettings()
QUICK_EVAL_EVERY = 3
#: every run keeps its policy's weights at the steps kept_steps() names (fixed before the runs),
#: as checkpoint folders ``<run>/KEPT_DIR/step_XXXXXXXX/`` (save_kept / load_kept; the trainer's own keep only the last):
#: what scripts/bench_fidelity.py scores each spec's credit on along its run
KEPT_DIR = "kept"
#: a budget with fewer eval points than this cannot draw a curve
MIN_EVALS = 2


def parse_tasks(value: Any) -> List[str]:
    items = value.split(",") if isinstance(value, str) else list(value or [])
    tasks = [str(t).strip() for t in items]
    if not tasks or any(not t for t in tasks):
        raise BenchError(f"--tasks: expected a comma-separated list of {list(SUITE)}, got {value!r}")
    for t in tasks:
        if t not in SUITE:
            raise BenchError(f"--tasks: expected tasks among {list(SUITE)} (enumerable, controlled), got {t!r}")
    if len(set(tasks)) != len(tasks):
        raise BenchError(f"--tasks: a task given twice in {value!r}")
    return tasks


def parse_policy(value: Any) -> str:
    if value not in POLICIES:
        raise BenchError(f"--policy: expected one of {list(POLICIES)}, got {value!r}")
    return value


def task_settings(task: str, policy: str = "full") -> TaskSettings:
    """The task's settings in the ``policy`` setting: SETTINGS, with LORA.lr under ``lora``."""
    s = SETTINGS[task]
    return dataclasses.replace(s, lr=LORA.lr) if parse_policy(policy) == "lora" else s


def task_dir(out: str | os.PathLike, task: str, policy: str = "full") -> Path:
    """Where the runs of ``task`` go: ``<out>/<task>/``, ``<out>/<task>-lora/`` in the LoRA setting
    (a run folder belongs to one setting: the two never mix)."""
    return Path(out) / (task if parse_policy(policy) == "full" else f"{task}-lora")


def kept_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where a run keeps its policy of ``step``: ``<run>/kept/step_XXXXXXXX/`` (a checkpoint folder)."""
    return Path(run_dir) / KEPT_DIR / f"step_{step:08d}"


def save_kept(model, run_dir: str | os.PathLike, step: int) -> Path:
    """Keep ``model``'s weights (its whole ``state_dict``) of ``step`` under ``<run>/kept/`` as the
    trainer's checkpoints are written (:func:`tokencredit.train.checkpoint.save_checkpoint`:
    atomic, with its sha256; none pruned)."""
    from ..train.checkpoint import save_checkpoint

    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return save_checkpoint(Path(run_dir) / KEPT_DIR, step, {"model": weights}, keep_last=10**9)


def kept_weights(run_dir: str | os.PathLike, step: int) -> Dict[str, Any]:
    """The weights a run kept at ``step``, read as the trainer's checkpoints are
    (:func:`~tokencredit.train.checkpoint.load_checkpoint`: ``weights_only``, its sha256 checked,
    finite): a :class:`~tokencredit.errors.CheckpointError` in one line otherwise."""
    from ..train.checkpoint import load_checkpoint

    return load_checkpoint(kept_path(run_dir, step))["model"]


def load_kept(model, run_dir: str | os.PathLike, step: int):
    """``model`` (a task's seeded policy) with the weights its run kept at ``step``: every weight
    checked against the model's (names, shapes, dtypes) before any is loaded."""
    from ..train.checkpoint import check_weights

    weights = kept_weights(run_dir, step)
    check_weights(weights, model.state_dict(), str(kept_path(run_dir, step)))
    model.load_state_dict(weights, strict=True)
    return model


def kept_steps(task: str, *, steps: Optional[int] = None, quick: bool = False) -> List[int]:
    """The steps whose weights a run of ``task`` keeps: 0 and every multiple of the task's
    ``keep_every`` up to the budget (QUICK_EVAL_EVERY with ``quick``), the last step included."""
    s = SETTINGS[task]
    n = steps if steps is not None else (QUICK_STEPS if quick else s.steps)
    every = QUICK_EVAL_EVERY if quick else s.keep_every
    return sorted(set(range(0, n + 1, every)) | {n})


def bench_config(task: str, *, steps: Optional[int] = None, eval_every: Optional[int] = None, policy: str = "full"):
    """The TrainConfig every run of ``task`` shares in the ``policy`` setting (credit, seed and
    output_dir set per run); ``lora``: ``model.lora`` with LORA's adapter and learning rate."""
    from ..train.config import (
        LogConfig,
        ModelConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )
    from ..data.controlled import CONTROLLED

    s = task_settings(task, policy)
    space = CONTROLLED[task].space
    lora = dict(lora=True, lora_r=LORA.r, lora_alpha=LORA.alpha, lora_targets=tuple(LORA.targets)) if policy == "lora" else {}
    return TrainConfig(
        steps=s.steps if steps is None else steps, threads=1, device="cpu", precision="fp32",
        model=ModelConfig(name=f"bench:{task}", **lora),
        task=TaskConfig(name=task, n_eval=64),
        rollout=RolloutConfig(prompts_per_step=s.prompts_per_step, samples_per_prompt=s.samples_per_prompt,
                              max_new_tokens=space.length, temperature=s.temperature),
        optim=OptimConfig(lr=s.lr, micro_batch_size=s.prompts_per_step * s.samples_per_prompt),
        # every response is exactly max_new_tokens long (the policy cannot end it): not a clipping
        reward=RewardConfig(clipped_warn_ratio=1.0),
        log=LogConfig(eval_every=s.eval_every if eval_every is None else eval_every, eval_samples=1, progress=False,
                      save_rollouts=False),
        save_every=s.eval_every if eval_every is None else eval_every,
        keep_last=1,
    )


# ---------------------------------------------------------------------------------------
# the runs


def _trainer_class():
    from ..train.trainer import Trainer

    class BenchTrainer(Trainer):
        """The own trainer; its eval adds ``bench/success``, the policy's exact success rate on the
        eval questions (mean V(h_0), enumerated: :func:`tokencredit.engine.exactvalue.prompt_values`)."""

        #: the steps whose weights this run keeps (set by make_trainer; none: keep none)
        keep_steps: Tuple[int, ...] = ()

        def evaluate(self) -> Dict[str, float]:
            from ..engine.exactvalue import prompt_values

            if self.step in self.keep_steps:
                self.keep_weights()
            metrics = super().evaluate()
            cache = self.__dict__.setdefault("_bench_leaf_cache", {})
            v = prompt_values(self.model, self.tokenizer, self.task.eval, self.task.response_space, self.task.reward,
                              temperature=self._temperature(), cache=cache)
            metrics["bench/success"] = float(v.mean())
            return metrics

        def keep_weights(self) -> Path:
            """The policy's weights at this step: :func:`save_kept`."""
            return save_kept(self.model, self.out, self.step)

    return BenchTrainer


def __getattr__(name):  # BenchTrainer imports the trainer only when asked for
    if name == "BenchTrainer":
        return _trainer_class()
    raise AttributeError(name)


def make_trainer(cfg, init_dir: Optional[str] = None, keep: Sequence[int] = ()):
    """A :class:`BenchTrainer` for ``cfg`` on its task's seeded policy (cached in ``init_dir``),
    keeping its weights at the steps ``keep`` (evaluated steps only: :func:`kept_steps`). With
    ``cfg.model.lora`` the policy is wrapped in its LoRA adapter here, drawn from ``cfg.seed``
    (the global RNG untouched), so that every spec of a seed starts from the same adapter."""
    import torch

    from .bench_policy import cached_policy

    model, tok = cached_policy(cfg.task.name, cfg.seed, Path(init_dir) if init_dir else None)
    if cfg.model.lora:
        from ..engine.models import add_lora

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = add_lora(model, r=cfg.model.lora_r, alpha=cfg.model.lora_alpha, target_modules=cfg.model.lora_targets)
    tr = _trainer_class()(cfg, model=model, tokenizer=tok)
    tr.keep_steps = tuple(keep)
    return tr


def check_runnable(task: str, spec: str, out: Path, policy: str = "full") -> None:
    """Refuse, in one line and before any model loads, a spec the own trainer cannot run in
    ``task``'s bench setting (its plan: e.g. ARCA needs a LoRA adapter the full-weight policy lacks)."""
    from .compare import run_config
    from ..errors import ConfigError
    from ..credit.spec import CreditPipeline
    from ..train.trainer import config_plan

    cfg = run_config(bench_config(task, policy=policy), spec, 0, task_dir(out, task, policy))
    try:
        config_plan(CreditPipeline(cfg.credit, cfg.method_configs()), cfg)
    except (ConfigError, ValueError) as e:
        raise BenchError(f"--credit: {spec} cannot run on {task}: {e}") from None


def _job(task: str, spec: str, seed: int, out: str, steps: Optional[int], eval_every: Optional[int],
         trainer_factory=None, policy: str = "full") -> Tuple[str, str, int, str]:
    import torch

    from .compare import run_config, run_one

    torch.set_num_threads(1)
    cfg = run_config(bench_config(task, steps=steps, eval_every=eval_every, policy=policy), spec, seed, task_dir(out, task, policy))
    keep = kept_steps(task, steps=steps, quick=eval_every == QUICK_EVAL_EVERY)
    factory = trainer_factory or partial(make_trainer, init_dir=str(Path(out) / "init"), keep=keep)
    status = run_one(cfg, factory, log=lambda s: None)
    return task, spec, seed, status


def _init(task: str, seed: int, out: str) -> None:
    import torch

    from .bench_policy import cached_policy

    torch.set_num_threads(1)
    cached_policy(task, seed, Path(out) / "init")


def _pool(workers: int):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))


def run_bench(tasks: Sequence[str] | str = SUITE, specs: Sequence[str] | str = DEFAULT_SPECS,
              seeds: Sequence[int] | str = DEFAULT_SEEDS, output_dir: str | Path = "runs/bench", *,
              quick: bool = False, workers: Optional[int] = None, steps: Optional[int] = None,
              progress: bool = True, trainer_factory=None, policy: str = "full") -> Dict[str, Any]:
    """Train every (task, spec, seed) not finished yet, then write the report. ``policy``: the
    setting, ``"full"`` (every weight trains) or ``"lora"`` (a LoRA adapter trains: LORA). ``quick``: the
    short budget (QUICK_STEPS, an eval every QUICK_EVAL_EVERY steps). ``workers``: processes
    (default: the CPUs this process may use, at most the runs); 1 runs in this process (and
    ``trainer_factory``, tests, replaces :func:`make_trainer`). Returns ``{"runs": {(task, spec,
    seed): status}, "report": path, "summary": {...}}``."""
    from tqdm.auto import tqdm

    from .compare import parse_seeds, parse_specs

    tasks = parse_tasks(tasks)
    policy = parse_policy(policy)
    try:
        specs = parse_specs(specs)
        seeds = parse_seeds(seeds)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if "grpo" not in specs or "oracle" not in specs:
        raise BenchError(f"--credit: expected grpo and oracle among the specs (the headroom's two ends), got {','.join(specs)}")
    eval_every = QUICK_EVAL_EVERY if quick else None
    steps = steps if steps is not None else (QUICK_STEPS if quick else None)
    for t in tasks:
        n, e = steps or SETTINGS[t].steps, eval_every or SETTINGS[t].eval_every
        if n // e < MIN_EVALS:
            raise BenchError(f"--steps: expected a budget of at least {MIN_EVALS} evals ({MIN_EVALS * e} steps on {t}), got {n}")
    if not isinstance(output_dir, (str, Path)) or not str(output_dir).strip():
        raise BenchError(f"--output-dir: expected a directory, got {output_dir!r}")
    for t in tasks:  # a spec the bench's setting cannot run is refused before any run trains
        for s in specs:
            check_runnable(t, str(s), Path(output_dir), policy)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"tasks": tasks, "specs": [str(s) for s in specs], "seeds": seeds, "quick": quick, "steps": steps, "policy": policy}
    old = out / "bench.json"
    if old.exists():
        prev = json.loads(old.read_text())
        if prev.get("policy", "full") != policy:
            raise BenchError(f"--policy: {out} holds a bench of the {prev.get('policy', 'full')!r} setting; expected the "
                             f"same ({policy!r}), or another --output-dir")
        if prev.get("quick") != quick or prev.get("steps") != steps:
            raise BenchError(f"--output-dir: {out} holds a bench with quick={prev.get('quick')}, steps={prev.get('steps')}; "
                             f"expected the same (quick={quick}, steps={steps}), or another directory")
    old.write_text(json.dumps(meta, indent=2))
    jobs = [(t, str(s), k) for t in tasks for s in specs for k in seeds]
    if workers is None:
        workers = max(1, min(len(os.sched_getaffinity(0)), len(jobs)))
    statuses: Dict[Tuple[str, str, int], str] = {}
    bar = tqdm(total=len(jobs), desc="bench", disable=not progress, unit="run")
    if workers == 1:
        for t, k in sorted({(t, k) for t, _, k in jobs}):
            if trainer_factory is None:
                _init(t, k, str(out))
        for t, s, k in jobs:
            statuses[(t, s, k)] = _job(t, s, k, str(out), steps, eval_every, trainer_factory, policy)[3]
            bar.update(1)
    else:
        if trainer_factory is not None:
            raise BenchError("trainer_factory: expected workers=1 with an injected factory, got workers > 1")
        with _pool(workers) as pool:
            inits = sorted({(t, k) for t, _, k in jobs})
            list(pool.map(_init, [t for t, _ in inits], [k for _, k in inits], [str(out)] * len(inits)))
            futures = [pool.submit(_job, t, s, k, str(out), steps, eval_every, None, policy) for t, s, k in jobs]
            from concurrent.futures import as_completed

            for f in as_completed(futures):
                t, s, k, st = f.result()
                statuses[(t, s, k)] = st
                bar.set_postfix_str(f"{t} {s} seed {k}: {st}")
                bar.update(1)
    bar.close()
    report, summary = write_bench_report(out, tasks, [str(s) for s in specs], seeds, steps=steps, eval_every=eval_every,
                                         policy=policy)
    return {"runs": statuses, "report": report, "summary": summary}


# ---------------------------------------------------------------------------------------
# measures (pure)


def bootstrap(values: Sequence[Sequence[float]], stat, *, n_boot: int = N_BOOT, seed: int = 0) -> Tuple[float, float, float]:
    """``(estimate, lo, hi)``: ``stat`` of the columns ``values`` (one list per quantity, paired:
    entry i of each is seed i) and its percentile interval over ``n_boot`` resamples of the seeds
    (the same seeds drawn for every column). Non-finite resamples are dropped."""
    cols = [np.asarray(v, dtype=float) for v in values]
    n = len(cols[0])
    est = float(stat(*cols))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    boots = np.array([stat(*[c[i] for c in cols]) for i in idx], dtype=float)
    boots = boots[np.isfinite(boots)]
    if n < 2 or not len(boots):
        return est, float("nan"), float("nan")
    a = (1 - COVERAGE) / 2
    return est, float(np.quantile(boots, a)), float(np.quantile(boots, 1 - a))


def _curve(rows: Sequence[Dict[str, float]], key: str = "bench/success") -> Tuple[List[int], List[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def auc(steps: Sequence[int], values: Sequence[float]) -> float:
    """Trapezoid area under the curve divided by its step range: the mean success over training."""
    if len(steps) < 2:
        return float("nan")
    return float(np.trapezoid(values, steps) / (steps[-1] - steps[0]))


def steps_to(steps: Sequence[int], values: Sequence[float], threshold: float) -> Optional[int]:
    return next((s for s, v in zip(steps, values) if v >= threshold), None)


def _mde(diffs: Sequence[float]) -> float:
    """The smallest paired mean difference n seeds detect with 80% power at a two-sided 5% level:
    (z_0.975 + z_0.8) x sd(d) / sqrt(n) = 2.80 x SE."""
    d = np.asarray(diffs, dtype=float)
    if len(d) < 2:
        return float("nan")
    return float(2.8016 * d.std(ddof=1) / math.sqrt(len(d)))


def summarize_task(results: Dict[str, Dict[int, List[Dict[str, float]]]], threshold: float, budget: int) -> Dict[str, Any]:
    """Per spec: the per-seed numbers and their summaries over the seeds every spec finished."""
    seeds = sorted(set.intersection(*[set(v) for v in results.values()])) if results else []
    per: Dict[str, Dict[str, List]] = {}
    for spec, by_seed in results.items():
        d = per[spec] = {"auc": [], "final": [], "greedy": [], "steps_to": [], "initial": [], "curve": {}}
        for k in seeds:
            st, v = _curve(by_seed[k])
            d["auc"].append(auc(st, v))
            d["final"].append(v[-1] if v else float("nan"))
            d["initial"].append(v[0] if v else float("nan"))
            gs, gv = _curve(by_seed[k], "eval/greedy_acc")
            d["greedy"].append(gv[-1] if gv else float("nan"))
            d["steps_to"].append(steps_to(st, v, threshold))
            for s, x in zip(st, v):
                d["curve"].setdefault(s, []).append(x)
    out: Dict[str, Any] = {"seeds": seeds, "threshold": threshold, "budget": budget, "specs": {}}
    g = per.get("grpo")
    o = per.get("oracle")
    diffs_all = []
    for spec, d in per.items():
        row = {
            "auc": bootstrap([d["auc"]], np.mean),
            "final": bootstrap([d["final"]], np.mean),
            "initial": bootstrap([d["initial"]], np.mean),
            "greedy_final": bootstrap([d["greedy"]], np.mean),
            "reached": sum(x is not None for x in d["steps_to"]),
            # unreached runs count as the budget (a lower bound)
            "steps_to": bootstrap([[x if x is not None else budget for x in d["steps_to"]]], np.mean),
            "per_seed_auc": d["auc"],
            "curve": {str(s): float(np.mean(v)) for s, v in sorted(d["curve"].items())},
        }
        if g is not None and spec != "grpo":
            diff = np.asarray(d["auc"]) - np.asarray(g["auc"])
            diffs_all.append(diff - diff.mean())
            row["auc_vs_grpo"] = bootstrap([d["auc"], g["auc"]], lambda a, b: float(np.mean(a - b)))
        if g is not None and o is not None and spec not in ("grpo",):
            row["headroom"] = bootstrap(
                [d["auc"], g["auc"], o["auc"]],
                lambda a, b, c: float(np.mean(a - b) / np.mean(c - b)) if abs(np.mean(c - b)) > 1e-12 else float("nan"))
        out["specs"][spec] = row
    n = len(seeds)
    if diffs_all and n >= 2:  # pooled sd of the paired differences to GRPO
        pooled = float(np.sqrt(np.mean([np.var(x, ddof=1) for x in diffs_all])))
        out["mde_auc"] = 2.8016 * pooled / math.sqrt(n)
    else:
        out["mde_auc"] = float("nan")
    return out


# ---------------------------------------------------------------------------------------
# report


def _fmt(t, digits: int = 3) -> str:
    est, lo, hi = t
    if not math.isfinite(est):
        return "–"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{est:.{digits}f}"
    return f"{est:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _plot(task: str, summary: Dict[str, Any], results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for spec, by_seed in results.items():
        curves = [_curve(by_seed[k]) for k in summary["seeds"]]
        if not curves or not curves[0][0]:
            continue
        steps = curves[0][0]
        vals = np.array([c[1][:len(steps)] for c in curves if len(c[1]) >= len(steps)])
        m = vals.mean(0)
        (line,) = ax.plot(steps, m, marker="o", ms=3, label=spec, lw=2.2 if spec in ("grpo", "oracle") else 1.2)
        if len(vals) > 1:
            se = vals.std(0, ddof=1) / math.sqrt(len(vals))
            ax.fill_between(steps, m - 1.96 * se, m + 1.96 * se, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("exact success rate (mean V(h_0))")
    ax.set_title(f"{task}: mean over {len(summary['seeds'])} seeds, band ±1.96 SE")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


#: a paired AUC difference smaller than this on a seed is "no difference" (the report prints 3 decimals)
NO_DIFFERENCE = 5e-4
_VERDICT_TEXT = {
    "separates": "the interval excludes 0: the task measures credit.",
    "includes 0": "the interval includes 0: on this budget the task does not separate oracle credit from GRPO.",
    "no difference": f"no difference on any seed (every seed's |oracle - grpo| AUC < {NO_DIFFERENCE:g}): on this budget "
                     "the task does not separate oracle credit from GRPO.",
}


def oracle_separation(summary: Dict[str, Any]) -> Optional[str]:
    """Whether oracle credit separates from GRPO on one task's :func:`summarize_task` output:
    ``"separates"`` where the printed interval of oracle - grpo AUC excludes 0 (its nearer end at
    least NO_DIFFERENCE away from 0), ``"no difference"`` where no seed's paired difference reaches
    NO_DIFFERENCE (a zero-width interval at 0 is not a separation), else ``"includes 0"``; None
    without both specs."""
    specs = summary.get("specs", {})
    o = specs.get("oracle", {}).get("auc_vs_grpo")
    if o is None or "grpo" not in specs:
        return None
    d = np.asarray(specs["oracle"]["per_seed_auc"], dtype=float) - np.asarray(specs["grpo"]["per_seed_auc"], dtype=float)
    if len(d) and np.all(np.abs(d) < NO_DIFFERENCE):
        return "no difference"
    if math.isfinite(o[1]) and (o[1] >= NO_DIFFERENCE or o[2] <= -NO_DIFFERENCE):
        return "separates"
    return "includes 0"


def render_bench_report(summaries: Dict[str, Dict[str, Any]], plots: Dict[str, str], meta: Dict[str, Any]) -> str:
    lines = ["# tokencredit bench", ""]
    for k, v in meta.items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "Each cell: the mean over seeds and its 95% paired bootstrap interval over seeds "
              f"({N_BOOT} resamples). Success is the policy's exact success rate on the eval questions "
              "(mean V(h_0) by enumeration). AUC: the mean success over training (trapezoid / steps). "
              "Headroom recovered: (AUC_spec - AUC_grpo) / (AUC_oracle - AUC_grpo). Steps to threshold: "
              "runs that never reach it count as the budget. Where the oracle's interval against grpo includes 0 the "
              "headroom's denominator is noise and the cell says n/a (summary.json keeps the number).", ""]
    for task, s in summaries.items():
        lines += [f"## {task}", "", f"seeds {','.join(map(str, s['seeds']))}; threshold {s['threshold']}; budget {s['budget']} steps; "
                  f"smallest AUC difference to GRPO the seeds detect (80% power, 5% two-sided): {s['mde_auc']:.3f}", ""]
        o = s["specs"].get("oracle", {}).get("auc_vs_grpo")
        verdict = oracle_separation(s)
        sep = verdict == "separates"
        lines.append("| spec | initial | AUC | AUC - grpo | headroom recovered | final success | final greedy | steps to threshold (reached) |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for spec, r in s["specs"].items():
            lines.append("| " + " | ".join([
                f"`{spec}`", _fmt(r["initial"]), _fmt(r["auc"]), _fmt(r["auc_vs_grpo"]) if "auc_vs_grpo" in r else "–",
                (_fmt(r["headroom"], 2) if sep else "n/a (oracle ~ grpo)") if "headroom" in r else "–",
                _fmt(r["final"]), _fmt(r["greedy_final"]),
                f"{_fmt(r['steps_to'], 1)} ({r['reached']}/{len(s['seeds'])})"]) + " |")
        if o is not None:
            lines += ["", f"oracle - grpo AUC: {_fmt(o)}: " + _VERDICT_TEXT[verdict]]
        if task in plots:
            lines += ["", f"![{task}]({plots[task]})"]
        lines.append("")
    return "\n".join(lines)


def write_bench_report(out: Path, tasks: Sequence[str], specs: Sequence[str], seeds: Sequence[int], *,
                       steps: Optional[int] = None, eval_every: Optional[int] = None,
                       policy: str = "full") -> Tuple[Path, Dict[str, Any]]:
    """Read every run (of the ``policy`` setting: :func:`task_dir`), write ``<out>/report.md``,
    ``<out>/summary.json`` and ``<out>/plots/<task>.png``."""
    from .compare import load_results

    out = Path(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    summaries, plots = {}, {}
    for t in tasks:
        budget = steps or SETTINGS[t].steps
        results = {s: r for s, r in load_results(task_dir(out, t, policy), specs, seeds, budget).items() if r}
        if not results:
            continue
        summaries[t] = summarize_task(results, SETTINGS[t].threshold, budget)
        p = out / "plots" / f"{t}.png"
        _plot(t, summaries[t], results, p)
        plots[t] = p.relative_to(out).as_posix()
    meta = {"tasks": ",".join(tasks), "specs": ",".join(specs), "seeds": ",".join(map(str, seeds)),
            "settings": "; ".join(f"{t}: {dataclasses.asdict(task_settings(t, policy))}" for t in tasks)
            + (f"; steps {steps}, eval every {eval_every}" if steps or eval_every else "")}
    if policy != "full":
        meta["policy"] = f"{policy}: {dataclasses.asdict(LORA)} (runs in <out>/<task>-lora/)"
    report = out / "report.md"
    report.write_text(render_bench_report(summaries, plots, meta))
    (out / "summary.json").write_text(json.dumps(summaries, indent=2, default=float))
    return report, summaries
