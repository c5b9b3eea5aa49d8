"""The ``tokencredit`` command."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


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
    from .config import load_config
    from .trainer import Trainer

    cfg = load_config(args.config, rest)
    trainer = Trainer(cfg)
    last = trainer.train()
    if trainer.step >= cfg.steps:
        path = trainer.export()
        print(f"final model written to {path}")
    keys = [k for k in ("reward/mean", "eval/greedy_acc", f"eval/mean@{cfg.log.eval_samples}", "entropy/mean") if k in last]
    print("last step: " + ", ".join(f"{k}={last[k]:.3f}" for k in keys))
    return 0


def _eval(args: argparse.Namespace, rest: List[str]) -> int:
    import json
    from pathlib import Path

    from .checkpoint import latest_checkpoint, load_checkpoint
    from .config import TrainConfig, _from_dict, load_config
    from .trainer import Trainer

    if args.run:
        run = Path(args.run)
        cfg_file = run / "config.json"
        if not cfg_file.exists():
            raise SystemExit(f"--run: {run} has no config.json (is it a tokencredit run directory?)")
        cfg = _from_dict(TrainConfig, json.loads(cfg_file.read_text()), "")
        if rest:
            raise SystemExit(f"eval --run takes no other options, got {rest}")
    else:
        cfg = load_config(args.config, rest)
    trainer = Trainer(cfg)
    if args.run:
        ck = latest_checkpoint(Path(args.run) / "checkpoints")
        if ck is None:
            raise SystemExit(f"--run: no checkpoint under {args.run}/checkpoints")
        trainer.load_state_dict(load_checkpoint(ck))
        print(f"evaluating {ck}")
    metrics = trainer.evaluate()
    print(json.dumps(metrics, indent=2))
    return 0


def _compare(args: argparse.Namespace, rest: List[str]) -> int:
    from .compare import parse_seeds, parse_specs, run_compare
    from .config import load_config

    for flag in ("--seed", "--credit", "--resume"):
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


def _compare_report(args: argparse.Namespace) -> int:
    """--report-only: rebuild the report from the runs already on disk."""
    import json
    from pathlib import Path

    from .compare import parse_seeds, parse_specs, write_report

    out = Path(args.output_dir)
    meta_file = out / "compare.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    try:
        specs = parse_specs(args.credit if args.credit else meta.get("specs"), "--credit")
        seeds = parse_seeds(args.seeds if args.seeds else meta.get("seeds"), "--seeds")
    except ValueError as e:
        raise SystemExit(f"tokencredit compare: {e}") from None
    path = write_report(out, specs, seeds, steps=meta.get("steps"))
    print(f"report: {path}")
    return 0


def _inspect(args: argparse.Namespace, rest: List[str]) -> int:
    from .inspector import write_page

    if rest:
        raise SystemExit(f"tokencredit inspect: unexpected arguments {rest}")
    try:
        path = write_page(args.rollouts, args.output, methods=args.methods, credit_args=tuple(args.credit_args))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"tokencredit inspect: {e}") from None
    print(f"page written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokencredit", description="token-level credit assignment for LLM RL")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("methods", help="list credit methods: kind, required signals, provenance")
    m.add_argument("--width", type=int, default=160, help="table width in characters")
    m.set_defaults(func=lambda a, rest: _methods(a))
    t = sub.add_parser(
        "train",
        help="train with a credit spec; other options are TrainConfig fields (see --help-config)",
        add_help=False,
    )
    t.add_argument("--config", default=None, help="YAML file of TrainConfig fields (overridden by flags)")
    t.set_defaults(func=_train)
    e = sub.add_parser("eval", help="greedy accuracy and mean@k of a run's latest checkpoint", add_help=False)
    e.add_argument("--run", default=None, help="a run directory written by 'tokencredit train'")
    e.add_argument("--config", default=None)
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
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "methods" and rest:
        raise SystemExit(f"tokencredit methods: unexpected arguments {rest}")
    # train/eval: everything not known to argparse goes to tyro (which also answers --help)
    return int(args.func(args, rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
