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
