"""The ``tokencredit`` command.

A user error (a bad setting, data file, reward function, checkpoint or run directory) prints one
line on stderr, ``tokencredit <command>: <field>: expected X, got Y``, and exits with code 2;
``--debug`` shows the traceback instead. An interrupted ``train`` or ``compare`` exits with 130.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

from .errors import one_line


def _user_errors() -> tuple:
    """The exception classes that are the user's to fix (each message is one line)."""
    from .errors import (
        CheckpointError,
        ConfigError,
        DatasetError,
        ExportError,
        ModelError,
        RewardFnError,
        UnknownMethodError,
    )

    return (ConfigError, CheckpointError, UnknownMethodError, DatasetError, RewardFnError, ModelError, ExportError)


class UserExit(SystemExit):
    """Exit status 2 for a user error; ``str()`` is the one-line message (already printed)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def _methods(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import tokencredit as tc

    table = Table(title="tokencredit credit methods", show_lines=False)
    for col in ("name", "kind", "signals", "provenance", "pairs with", "summary"):
        table.add_column(col)
    for name in tc.list_methods():
        m = tc.get_method(name)
        table.add_row(
            m.name,
            m.kind,
            ", ".join(sorted(m.requires)) or "-",
            m.provenance,
            m.paired_with or "-",
            m.summary,
        )
    Console(width=args.width).print(table)
    return 0


def _train(args: argparse.Namespace, rest: List[str]) -> int:
    from .train.config import load_config
    from .train.trainer import Trainer

    cfg = load_config(args.config, rest)
    trainer = Trainer(cfg)
    last = trainer.train()
    if trainer.step < cfg.steps:  # stopped by Ctrl-C or SIGTERM (the trainer said where it stands)
        if trainer.stopped_by == "SIGTERM":  # 128 + 15, as a process killed by SIGTERM
            print(f"train stopped by SIGTERM at step {trainer.step} of {cfg.steps}; continue with --resume "
                  f"--output-dir {trainer.out}", file=sys.stderr)
            return 143
        print(f"train interrupted at step {trainer.step} of {cfg.steps}", file=sys.stderr)
        return 130
    if not last:  # --resume of a run that had already reached cfg.steps
        path = trainer.export(reuse=True)  # final/ as it is if whole and of this step, else written again
        print(f"nothing to train: the run is at step {trainer.step} of {cfg.steps} (raise --steps to go on); final model in {path}")
        return 0
    path = trainer.export()
    print(f"final model written to {path}")
    keys = [k for k in ("reward", "eval/greedy_acc", f"eval/mean@{cfg.log.eval_samples}", "entropy") if k in last]
    print("last step: " + ", ".join(f"{k}={last[k]:.3f}" for k in keys))
    return 0


def _eval_data(cfg, rest: List[str]):
    """``eval``'s own data (``--data.path``): every row of the eval file (of ``data.path`` itself
    when it has no eval split), at most ``task.n_eval`` only when that is asked for. None for a
    built-in task."""
    if cfg.data.path is None:
        return None
    from .train.config import TaskConfig
    from .data.tasks import make_data_task

    asked = cfg.task.n_eval != TaskConfig().n_eval or any(a.split("=")[0] in ("--task.n-eval", "--task.n_eval") for a in rest)
    return make_data_task(cfg.data, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval if asked else sys.maxsize,
                          hold_out=False)


def _eval_rows_line(task, cfg) -> str:
    """How many rows ``eval`` scores, of how many, and why not all."""
    n, src = len(task.eval), task.eval_source
    if src is None:
        return f"eval: scoring {n} rows of task {task.name!r} (task.n_eval {cfg.task.n_eval})"
    if src["held_out"]:
        from .data.datasource import DATA_EVAL_FRACTION

        frac = cfg.data.eval_fraction if cfg.data.eval_fraction is not None else DATA_EVAL_FRACTION
        return f"eval: scoring {n} of {src['of']} rows of {src['where']!r} (held out by data.eval_fraction {frac})"
    if n == src["of"]:
        return f"eval: scoring all {n} rows of {src['where']!r}"
    return f"eval: scoring {n} of {src['of']} rows of {src['where']!r} (task.n_eval {cfg.task.n_eval})"


def _eval(args: argparse.Namespace, rest: List[str]) -> int:
    """Evaluate a run's latest intact checkpoint (``--run``), or the model a config names.

    With ``--run DIR`` nothing in DIR is written: results go to ``--output-dir`` (default: the
    sibling folder ``DIR-eval``), as ``eval/samples_step_XXXXXXXX.jsonl`` and
    ``eval_step_XXXXXXXX.json``. The run's own ``output_dir`` setting is not used (it may be
    relative to wherever the run was started)."""
    import dataclasses
    import json
    from pathlib import Path

    from .train.config import ConfigError, load_config
    from .train.runfolder import RunFolder
    from .train.trainer import Trainer

    if not args.run:
        if args.output_dir:
            rest = rest + ["--output-dir", args.output_dir]
        cfg = load_config(args.config, rest).validate()
        trainer = Trainer(cfg, task=_eval_data(cfg, rest))
        print(_eval_rows_line(trainer.task, cfg), file=sys.stderr)
        metrics = {**trainer.evaluate(), "eval/rows": len(trainer.task.eval)}
        print(json.dumps(metrics, indent=2))
        return 0
    if rest or args.config:
        raise ConfigError(f"eval --run: expected no other options than --output-dir, got {rest + (['--config'] if args.config else [])}")
    folder = RunFolder(args.run, arg="--run")
    run = folder.path.resolve()
    saved = folder.config()
    out = Path(args.output_dir) if args.output_dir else run.parent / f"{run.name}-eval"
    if out.resolve() == run or run in out.resolve().parents:
        raise ConfigError(f"--output-dir: expected a folder outside the run {str(run)!r}, got {str(out)!r}")
    cfg = dataclasses.replace(saved, output_dir=str(out), resume=False)
    cfg_file = folder.config_file.resolve()
    from .data.rewards import user_code

    code = user_code(cfg)  # a folder someone sent runs nothing of theirs unasked
    if code and not args.trust_remote_code:
        raise ConfigError(f"--run: {cfg_file} names reward code that eval would import and run: {'; '.join(code)}; "
                          f"read it, then add --trust-remote-code to run it")
    if code:
        print(f"eval: running the reward code {cfg_file} names (--trust-remote-code): {'; '.join(code)}", file=sys.stderr)
    ck, state = folder.load_latest()
    trainer = Trainer(cfg)
    trainer.load_state_dict(state)
    print(f"evaluating {ck}", file=sys.stderr)
    print(_eval_rows_line(trainer.task, cfg), file=sys.stderr)
    metrics = {**trainer.evaluate(), "eval/rows": len(trainer.task.eval)}
    out.mkdir(parents=True, exist_ok=True)
    result = out / f"eval_step_{trainer.step:08d}.json"
    result.write_text(json.dumps({"run": str(run), "checkpoint": str(ck), "step": trainer.step, **metrics}, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    print(f"written to {result}", file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace, rest: List[str]) -> int:
    from .analysis.compare import parse_seeds, parse_specs, run_compare
    from .train.config import load_config

    for flag in ("--seed", "--credit", "--resume", "--overwrite"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise SystemExit(
                f"tokencredit compare: {flag} is set per run by compare; use --credit A,B and --seeds 0,1"
            )
    try:
        specs = parse_specs(args.credit, "--credit")
        seeds = parse_seeds(args.seeds, "--seeds")
    except ValueError as e:
        raise SystemExit(f"tokencredit compare: {e}") from None
    base = load_config(args.config, rest)
    try:
        result = run_compare(base, specs, seeds, args.output_dir, progress=not args.quiet, report=True)
    except KeyboardInterrupt as e:
        print(f"\ncompare interrupted ({e}); rerun the same command to resume")
        return 130
    except ValueError as e:
        raise SystemExit(f"tokencredit compare: {e}") from None
    print(f"report: {result['report']}")
    return 0


def _bench(args: argparse.Namespace, rest: List[str]) -> int:
    from .analysis.bench import (
        DEFAULT_SEEDS,
        DEFAULT_SPECS,
        QUICK_SEEDS,
        QUICK_SPECS,
        SUITE,
        BenchError,
        run_bench,
    )

    if rest:
        raise SystemExit(f"tokencredit bench: unexpected arguments {rest}; the settings are fixed per task (tokencredit.analysis.bench.SETTINGS)")
    try:
        result = run_bench(args.tasks or ",".join(SUITE), args.credit or ",".join(QUICK_SPECS if args.quick else DEFAULT_SPECS),
                           args.seeds or ",".join(map(str, QUICK_SEEDS if args.quick else DEFAULT_SEEDS)), args.output_dir,
                           quick=args.quick, workers=args.workers, steps=args.steps, progress=not args.quiet,
                           policy=args.policy)
    except KeyboardInterrupt:
        print("\nbench interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except BenchError as e:
        raise SystemExit(f"tokencredit bench: {e}") from None
    print(f"report: {result['report']}")
    return 0


def _compare_report(args: argparse.Namespace) -> int:
    """--report-only: rebuild the report from the runs already on disk."""
    import json
    from pathlib import Path

    from .analysis.compare import parse_seeds, parse_specs, read_meta, write_report

    out = Path(args.output_dir)
    try:
        meta = read_meta(out) if not (args.credit and args.seeds) else {}
        specs = parse_specs(args.credit if args.credit else meta.get("specs"), "--credit")
        seeds = parse_seeds(args.seeds if args.seeds else meta.get("seeds"), "--seeds")
        path = write_report(out, specs, seeds, steps=meta.get("steps"))
    except ValueError as e:
        raise SystemExit(f"tokencredit compare: {e}") from None
    print(f"report: {path}")
    return 0


def _inspect(args: argparse.Namespace, rest: List[str]) -> int:
    from .analysis.inspector import write_page

    if rest:
        raise SystemExit(f"tokencredit inspect: unexpected arguments {rest}")
    from .analysis.fidelity import is_estimates_file, load_estimates, rollouts_with_true_credit

    try:
        # a fidelity estimates file: its rollouts, with the true credit as one more row
        saved = (rollouts_with_true_credit(load_estimates(args.rollouts, require_complete=False))
                 if is_estimates_file(args.rollouts) else None)
        path = write_page(args.rollouts, args.output, methods=args.methods, credit_args=tuple(args.credit_args), saved=saved)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"tokencredit inspect: {e}") from None
    print(f"page written to {path}")
    return 0


def _export(args: argparse.Namespace, rest: List[str]) -> int:
    from .train.export import export_run

    if rest:
        raise SystemExit(f"tokencredit export: unexpected arguments {rest}")
    path = export_run(args.run, args.to, merge_lora=args.merge_lora, checkpoint=args.checkpoint)
    print(f"exported to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokencredit", description="token-level credit assignment for LLM RL")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors (accepted anywhere on the line)")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("methods", help="list credit methods: kind, required signals, provenance")
    m.add_argument("--width", type=int, default=160, help="table width in characters")
    m.set_defaults(func=lambda a, rest: _methods(a))
    t = sub.add_parser(
        "train",
        help="train with a credit spec; other options are TrainConfig fields ('tokencredit train --help' or --help-config lists them)",
        add_help=False,
    )
    t.add_argument("--config", default=None, help="YAML file of TrainConfig fields (overridden by flags)")
    t.set_defaults(func=_train)
    e = sub.add_parser(
        "eval", help="greedy accuracy and mean@k of a run's latest checkpoint",
        description="Evaluate RUN's newest intact checkpoint (--run), writing to --output-dir (default RUN-eval; RUN is "
        "left unchanged); without --run, the model a config names, with TrainConfig fields as for 'tokencredit train' "
        "('tokencredit train --help' lists them).",
    )
    e.add_argument("--run", default=None, help="a run directory written by 'tokencredit train' (left unchanged)")
    e.add_argument("--output-dir", "--output_dir", dest="output_dir", default=None,
                   help="where the results go (default with --run: RUN-eval, next to the run)")
    e.add_argument("--config", default=None)
    e.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true",
                   help="with --run: import and run the reward code (reward.funcs, task.reward_fn) RUN's config.json names")
    e.set_defaults(func=_eval)
    c = sub.add_parser(
        "compare",
        help="train several credit specs on the same task, model, seeds and budget; write a report",
        description="Train every spec x seed (resumable runs in OUT/<spec>/seed<k>/), then write "
        "OUT/report.md and OUT/plots/*.png. Other options are TrainConfig fields, as for "
        "'tokencredit train' (e.g. --steps 20 --task.name add1).",
        allow_abbrev=False,
    )
    c.add_argument("--credit", default=None, help="comma-separated credit specs or recipes, e.g. grpo,taco,oppo+stare")
    c.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    c.add_argument("--output-dir", "--output_dir", dest="output_dir", default="runs/compare", help="where runs and the report go")
    c.add_argument("--config", default=None, help="YAML file of TrainConfig fields shared by every run")
    c.add_argument("--report-only", action="store_true", help="do not train; rebuild the report from the runs on disk")
    c.add_argument("--quiet", action="store_true", help="no progress lines")
    c.set_defaults(func=lambda a, rest: _compare_report(a) if a.report_only else _compare(a, rest))
    b = sub.add_parser(
        "bench",
        help="does credit matter? credit specs x seeds on controlled tasks with exact true credit (oracle) as the ceiling",
        description="Train every task x spec x seed (resumable runs in OUT/<task>/<spec>/seed<k>/, the own trainer), "
        "then write OUT/report.md, OUT/summary.json and OUT/plots/<task>.png: exact success curves, AUC, headroom "
        "recovered against grpo and oracle, bootstrap intervals over paired seeds.",
        allow_abbrev=False,
    )
    b.add_argument("--tasks", default=None, help="comma-separated tasks (default: keytok,carry,fork)")
    b.add_argument("--credit", default=None, help="comma-separated credit specs, grpo and oracle among them (default: tokencredit.analysis.bench.DEFAULT_SPECS)")
    b.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0..9; --quick: 0,1)")
    b.add_argument("--quick", action="store_true", help="grpo,oracle x 2 seeds x a few steps (< 5 minutes)")
    b.add_argument("--steps", type=int, default=None, help="training steps of every run (default: the task's)")
    b.add_argument("--workers", type=int, default=None, help="parallel processes (default: the CPUs available)")
    b.add_argument("--output-dir", "--output_dir", dest="output_dir", default="runs/bench", help="where runs and the report go")
    b.add_argument("--policy", default="full", help="what trains: 'full' (every weight of the bench policy) or 'lora' "
                   "(a LoRA adapter on it, tokencredit.analysis.bench.LORA: r 8, alpha 16, every projection, its own lr; "
                   "every spec through the same adapter, runs in OUT/<task>-lora/; the setting grpo+arca needs)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=_bench)
    i = sub.add_parser(
        "inspect",
        help="an HTML page of token credit per method on a saved rollout batch",
        description="Replay a saved rollout batch (eval/rollouts_step_*.pt, or a run directory: its "
        "latest) through every method whose signals it has and write one self-contained HTML page.",
        allow_abbrev=False,
    )
    i.add_argument("rollouts", metavar="ROLLOUTS", help="a rollouts_step_*.pt file or a run directory")
    i.add_argument("--methods", default=None, help="comma-separated credit specs (default: every registered spec plus a few compositions)")
    i.add_argument("-o", "--output", default=None, help="the HTML file (default: ROLLOUTS with .html)")
    i.add_argument("--credit-args", nargs="*", default=[], metavar="METHOD.FIELD=VALUE", help="method configs for the replay, e.g. taco.lam=0.5")
    i.set_defaults(func=_inspect)
    # credit fidelity: every option is parsed by tokencredit.analysis.fidelity.main (see its --help)
    x = sub.add_parser(
        "export",
        help="write a run's model as a from_pretrained folder (a checkpoint's weights in its base model)",
        description="Write RUN's model (its newest intact checkpoint, or --checkpoint STEP) to DIR, a folder that "
        "AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load. A LoRA run gives its adapter "
        "(recording its base model as a hub id or an absolute path), or with --merge-lora the merged model.",
        allow_abbrev=False,
    )
    x.add_argument("run", metavar="RUN", help="a run folder written by 'tokencredit train'")
    x.add_argument("--to", required=True, metavar="DIR", help="a new or empty folder")
    x.add_argument("--merge-lora", action="store_true", help="merge a LoRA adapter into the base model (a full model)")
    x.add_argument("--checkpoint", type=int, default=None, metavar="STEP", help="the checkpoint's step (default: the newest intact one)")
    x.set_defaults(func=_export)
    fd = sub.add_parser("fidelity", add_help=False, help="score every method's token credit against Monte Carlo true credit "
                        "(no argument: the bundled reference set); 'fidelity build RUN -o FILE' estimates it")
    fd.set_defaults(func=lambda a, rest: __import__("tokencredit.analysis.fidelity", fromlist=["main"]).main(rest))
    return p


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] == ["--help-config"]:  # every TrainConfig field with its default and help
        argv = ["train", "--help"]
    args, rest = build_parser().parse_known_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn_one_line  # restored on exit
            if args.command == "methods" and rest:
                raise SystemExit(f"tokencredit methods: unexpected arguments {rest}")
            # train/eval: everything not known to argparse goes to tyro (which also answers --help)
            return int(args.func(args, rest) or 0)
    except KeyboardInterrupt:
        print(f"\ntokencredit {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e, UserExit) or not isinstance(e.code, str):
            raise
        msg = one_line(e)  # a subcommand's own one-line refusal
        print(msg, file=sys.stderr)
        raise UserExit(msg) from None
    except Exception as e:
        from .errors import is_disk_full
        from .train.trainer import NonFiniteError

        disk_full = is_disk_full(e)
        if debug or not (disk_full or isinstance(e, _user_errors() + (NonFiniteError,))):
            raise
        if disk_full and "no space left" not in str(e):  # a write outside the run's own writers
            e = OSError(f"no space left on device writing {e.filename!r}" if e.filename else "no space left on device")
        msg = f"tokencredit {args.command}: {one_line(e)}"
        print(msg, file=sys.stderr)
        if disk_full or isinstance(e, NonFiniteError):  # the run failed, the input was fine: exit 1
            raise SystemExit(1) from None
        raise UserExit(msg) from None


if __name__ == "__main__":
    raise SystemExit(main())
