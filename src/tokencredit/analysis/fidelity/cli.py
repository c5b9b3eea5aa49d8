"""The command line: ``tokencredit fidelity [FILE]`` (the table; ``--claims``, ``--figure``,
``--json``), ``tokencredit fidelity build`` (estimates for a run's saved batch, or for a batch
it samples itself from ``--model`` on ``--task``; ``--exact`` for the exact tier) and
``tokencredit fidelity critic`` (the critic of a run of a method that declares one, evaluated
on a file's batch). Every user error is one line, ``tokencredit fidelity[ build| critic]: FIELD:
...``. A build resumes an existing estimates file; ``--overwrite`` starts again after moving
the file (and a ``--task`` build's batch folder ``FILE.run``) aside to ``<name>.old-<k>``, as
``tokencredit train --overwrite`` moves a run aside: nothing is deleted."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...train.runfolder import RunFolder, aside_name
from .base import (
    REFERENCE_EXACT,
    REFERENCE_EXACT_COMMAND,
    REFERENCE_SET,
    REFERENCE_SPANS_CRN,
    REFERENCE_TOKENS,
    REFERENCE_TOKENS_CRN,
    EstimatesMismatch,
    FidelityError,
    atomic_save,
    check_rows,
    response_lengths,
)
from .claims import CLAIM_SPECS, claims, format_claims
from .estimates import attach_critic, build_estimates, critic_values, load_estimates
from .exact import exact_estimates
from .metrics import FidelityConfig, critic_method, format_table, score
from .plots import plot_responses
from .sampling import check_policy, sample_batch

__all__ = ["main"]


def _score_main(argv: List[str]) -> int:
    from ...train.records import parse_methods

    p = argparse.ArgumentParser(prog="tokencredit fidelity", description="score every method's token credit against Monte Carlo true credit")
    p.add_argument("file", nargs="?", default=None, help="an estimates file (default: the bundled reference set)")
    p.add_argument("--reference", choices=("spans", "spans-crn", "tokens", "tokens-crn", "exact"), default="spans-crn",
                   help="without FILE, which bundled set: V every 4th position for all 64 responses with common "
                        "random numbers (spans-crn, the default: a noise ceiling of 0.91) or independent continuations "
                        "(spans: 0.51), at "
                        "every position of the same batch's first groups with mixed outcomes (tokens), the same with "
                        "common random numbers (tokens-crn), or exact V of a digit-restricted policy on mul1 (exact)")
    p.add_argument("--methods", default=None, help="comma-separated credit specs (default: what inspect replays)")
    p.add_argument("--credit-args", nargs="*", default=[], metavar="METHOD.FIELD=VALUE")
    p.add_argument("--delta", type=float, default=FidelityConfig.delta)
    p.add_argument("--n-boot", type=int, default=FidelityConfig.n_boot)
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--figure", default=None, help="also write a PNG of a few responses' c_t against each method's A_t")
    p.add_argument("--claims", action="store_true", help="also print the numbers behind docs/fidelity.md's answers to "
                   "the papers' token-level claims (sparsity, TACO's tail tokens, where each method's credit goes)")
    a = p.parse_args(argv)
    try:
        ref = {"spans": REFERENCE_SET, "spans-crn": REFERENCE_SPANS_CRN, "tokens": REFERENCE_TOKENS, "tokens-crn": REFERENCE_TOKENS_CRN,
               "exact": REFERENCE_EXACT}[a.reference]
        if a.file is None and not ref.is_file():
            if a.reference == "spans":
                how = ""
            elif a.reference == "spans-crn":
                how = (" --crn --steps 3 --stride 4 --rows all --rollouts-from " + str(REFERENCE_SET)
                       + f" --work-dir build/fidelity_{a.reference} --output " + str(ref))
            else:
                how = (" --steps 3 --stride 1 --rows mixed --rollouts-from " + str(REFERENCE_SET)
                       + (" --crn" if a.reference == "tokens-crn" else "")
                       + f" --work-dir build/fidelity_{a.reference} --output " + str(ref))
            cmd = REFERENCE_EXACT_COMMAND if a.reference == "exact" else f"python scripts/build_fidelity_set.py{how}"
            raise FidelityError(f"no bundled reference set at {ref}: build it with '{cmd}' "
                                "(docs/fidelity.md) or pass an estimates file")
        est = load_estimates(a.file or ref)
        specs = parse_methods(a.methods) if a.methods is not None else None
        cfg = FidelityConfig(delta=a.delta, n_boot=a.n_boot)
        res = score(est, specs, credit_args=tuple(a.credit_args), cfg=cfg)
        if a.claims:
            res["claims"] = claims(est, CLAIM_SPECS if specs is None else specs, credit_args=tuple(a.credit_args), cfg=cfg)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tokencredit fidelity: {e}") from None
    print(json.dumps(res, indent=2, allow_nan=True) if a.json else format_table(res))
    if a.claims and not a.json:
        print("\n" + format_claims(res["claims"]))
    if a.figure:
        print(f"figure written to {plot_responses(est, a.figure)}", file=sys.stderr)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokencredit fidelity build",
        description="Monte Carlo V(h_t) for a run's saved rollout batch (from the checkpoint that sampled it), "
                    "or for a batch it samples itself from --model on --task")
    p.add_argument("rollouts", nargs="?", default=None,
                   help="a run directory (its latest eval/rollouts_step_*.pt) or a rollouts file inside one; "
                        "omit it to sample a batch from --model on --task")
    p.add_argument("-o", "--output", required=True, help="the estimates file (resumed when it exists, but with --exact)")
    p.add_argument("--overwrite", action="store_true", help="start again: move an existing estimates file to "
                   "FILE.old-<k> and a --task build's batch folder FILE.run to FILE.run.old-<k> (nothing is deleted)")
    p.add_argument("--checkpoint", default=None, help="the checkpoint folder of the policy that sampled the batch "
                   "(default: RUN/checkpoints/step_<S-1>, S the rollouts' step)")
    p.add_argument("-M", type=int, default=16, help="continuations per position (even)")
    p.add_argument("--stride", type=int, default=1, help="estimate every k-th position (credit compared per span)")
    p.add_argument("--rows", default=None, help="estimate only these responses (comma-separated indices; default all)")
    p.add_argument("--rows-per-batch", type=int, default=128, help="prefixes x M per generate call (128: docs/fidelity.md)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (resumably) after this long")
    p.add_argument("--crn", action="store_true", help="common random numbers: the continuations of neighbouring prefixes "
                   "share their sampling noise, so V(h_t) and V(h_t+1) are estimated with correlated errors (docs/fidelity.md)")
    p.add_argument("--exact", action="store_true", help="the exact tier (with --task): a batch sampled from the model restricted "
                   "to the digits and its end token, V by enumerating every continuation (docs/fidelity.md)")
    g = p.add_argument_group("sampling a batch (no ROLLOUTS): the trainer's own step at learning rate 0, every signal kept")
    g.add_argument("--model", default=None, help="model name or path (default with --task: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--task", default=None, help="task name (e.g. chain, mul1)")
    g.add_argument("--lora", action="store_true",
                   help="give the model a fresh LoRA adapter (peft's init: B = 0, so the policy is the model's own and "
                        "ARCA's residual and the divergence are 0; for non-trivial ones build from a LoRA run's rollouts)")
    g.add_argument("--prompts", type=int, default=16)
    g.add_argument("--samples", type=int, default=4, help="responses per prompt (the group size)")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.7)
    return p


def _build_main(argv: List[str]) -> int:
    a = _build_parser().parse_args(argv)
    try:
        if (a.rollouts is None) == (a.task is None):
            raise FidelityError(f"ROLLOUTS: expected a run's rollouts or --task (a batch to sample), got "
                                f"{'both' if a.task else 'neither'}")
        if a.rollouts is not None and a.model is not None:
            raise FidelityError("--model: the policy of a run's rollouts is the run's own; expected no --model with ROLLOUTS")
        if a.exact:
            return _build_exact(a)
        return _build_from_run(a) if a.rollouts is not None else _build_from_task(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tokencredit fidelity build: {e}") from None


def _start_again(out: Path, *, task: bool) -> None:
    """``--overwrite``: the estimates file ``out`` and (a ``--task`` build) its batch folder
    moved aside; called after every check, before any model loads. A folder another build holds
    is refused (the message names its pid)."""
    from ...train.runfolder import check_run_folder

    run = out.with_name(out.name + ".run")
    if task and run.exists():
        check_run_folder(run, resume=False, overwrite=True)
    for p in (out, run) if task else (out,):
        if p.exists():
            to = aside_name(p)
            p.rename(to)
            print(f"--overwrite: {p} moved to {to}", file=sys.stderr)


def _overwrite_hint(p: Path) -> str:
    return f"start again with --overwrite ({str(p)!r} is moved to {str(aside_name(p))!r}, nothing is deleted) or choose another -o"


def _parse_rows(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FidelityError(f"--rows: expected comma-separated response indices, got {text!r}") from None


def _run_of(rollouts_file: Path) -> Path:
    return rollouts_file.parent.parent if rollouts_file.parent.name == "eval" else rollouts_file.parent


def _load_run(run: Path, checkpoint: Optional[Path], *, critic: bool = False):
    """A run's config, its model (LoRA as configured) with a checkpoint's weights, the tokenizer
    and, with ``critic``, the checkpoint's value head (``runfolder.RunFolder.load_model``: checked
    before any model loads; every trainable weight of its shape and dtype). ``checkpoint`` None:
    the initial weights. A checkpoint that cannot be used is a :class:`FidelityError`."""
    from ...train.checkpoint import CheckpointError

    try:
        got = RunFolder(run, arg="RUN", error=FidelityError).load_model(checkpoint, critic=critic)
    except CheckpointError as e:
        raise FidelityError(str(e)) from None
    return got.config, got.model, got.tokenizer, got.critic


def _copy_weights(model, weights: Dict[str, torch.Tensor], where: str) -> None:
    """Copy ``weights`` (name -> tensor) into ``model``'s parameters; a name it lacks is an error."""
    params = dict(model.named_parameters())
    extra = sorted(set(weights) - set(params))
    if extra:
        raise FidelityError(f"{where} has weight {extra[0]!r} that this model lacks (another model?)")
    with torch.no_grad():
        for n, v in weights.items():
            params[n].copy_(v)


def _task_examples(cfg, saved: Dict[str, Any]):
    from ...data.tasks import make_task

    task = make_task(cfg.task.name, seed=cfg.seed, n_train=cfg.task.n_train, n_eval=cfg.task.n_eval,
                     path=cfg.task.path, reward_fn=cfg.task.reward_fn)
    by_q = {e.question: e for e in list(task.train) + list(task.eval)}
    qs = saved.get("questions") or []
    missing = [q for q in qs if q not in by_q]
    if missing or len(qs) != len(response_lengths(saved)):
        raise FidelityError(f"ROLLOUTS: {len(missing)} question(s) not in task {cfg.task.name!r} (e.g. {missing[:1]!r}): another task?")
    return task, [by_q[q] for q in qs]


def _estimate(a, cfg, model, tok, saved: Dict[str, Any], policy: str) -> int:
    from ...data.tasks import score_safely

    task, exs = _task_examples(cfg, saved)
    saved = dict(saved, messages=[list(e.messages) for e in exs])

    def reward(text, b):
        return score_safely(task.reward, text, exs[b], cfg.task.reward_timeout_s)

    try:
        build_estimates(saved, model, tok, reward, a.output, M=a.M, stride=a.stride, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens, rows_per_batch=a.rows_per_batch,
                        seed=a.seed, policy=policy, rows=_parse_rows(a.rows), crn=a.crn,
                        max_seconds=None if a.max_minutes is None else a.max_minutes * 60)
    except EstimatesMismatch as e:
        raise FidelityError(f"{e}; {_overwrite_hint(Path(a.output))}") from None
    print(f"estimates written to {a.output}")
    return 0


def _build_from_run(a) -> int:
    from ...train.records import find_rollouts, load_rollouts

    if a.threads:
        torch.set_num_threads(a.threads)
    src = find_rollouts(a.rollouts)
    run = _run_of(src)
    saved = load_rollouts(src)
    check_rows(_parse_rows(a.rows), len(response_lengths(saved)))  # before any model loads
    step = int(saved.get("step") or 0)
    ck = Path(a.checkpoint) if a.checkpoint else run / "checkpoints" / f"step_{step - 1:08d}"
    if (step > 1 or a.checkpoint) and not ck.exists():
        raise FidelityError(f"--checkpoint: the batch of step {step} was sampled by the weights after step {step - 1}; "
                            f"no checkpoint {ck} (pass --checkpoint, or save every step)")
    use = ck if step > 1 or a.checkpoint else None
    if a.overwrite:
        _start_again(Path(a.output), task=False)
    cfg, model, tok, _ = _load_run(run, use)
    policy = f"{cfg.model.name}{' + LoRA' if cfg.model.lora else ''} from {use if use is not None else 'the initial weights'}"
    return _estimate(a, cfg, model, tok, saved, policy)


def _build_from_task(a) -> int:
    from ...train.config import LogConfig, ModelConfig, OptimConfig, RolloutConfig, TaskConfig, TrainConfig
    from ...engine.models import EMBEDDED
    from ...train.runfolder import holds_run
    from ...train.trainer import Trainer

    out = Path(a.output)
    run = out.with_name(out.name + ".run")
    if out.exists() and not a.overwrite:  # resume: the batch is the file's own
        est = load_estimates(out, require_complete=False)
        cfg, model, tok, _ = _load_run(run, None)
        if (cfg.model.name, cfg.task.name) != (a.model or EMBEDDED, a.task):
            raise FidelityError(f"ESTIMATES: {out} samples {cfg.model.name} on {cfg.task.name}; expected {a.model or EMBEDDED} on {a.task}")
        if cfg.model.lora:
            _copy_weights(model, torch.load(run / "adapter.pt", map_location="cpu", weights_only=True), f"ESTIMATES: {run / 'adapter.pt'}")
        return _estimate(a, cfg, model, tok, est["rollouts"], est.get("policy", ""))
    if holds_run(run) and not a.overwrite:
        raise FidelityError(f"-o: {str(run)!r} holds the batch of an earlier build that wrote no estimates file {str(out)!r} "
                            f"(stopped before its first batch?); {_overwrite_hint(run)}")
    cfg = TrainConfig(  # the trainer's default credit: the batch is the policy's, whatever is scored on it
        steps=1, seed=a.seed, threads=a.threads, output_dir=str(run),
        model=ModelConfig(name=a.model or EMBEDDED, lora=a.lora),
        task=TaskConfig(name=a.task),
        rollout=RolloutConfig(prompts_per_step=a.prompts, samples_per_prompt=a.samples, max_new_tokens=a.max_new_tokens,
                              temperature=a.temperature),
        optim=OptimConfig(micro_batch_size=max(1, a.prompts * a.samples)),
        log=LogConfig(eval_samples=0, eval_at_start=False, progress=False),
    )
    cfg.validate()
    check_rows(_parse_rows(a.rows), a.prompts * a.samples)  # before any model loads
    if a.overwrite:
        _start_again(out, task=True)
    trainer = Trainer(cfg)
    trainer.open_logs()  # config.json: a resumed build reloads the same model and task
    saved = sample_batch(trainer, a.prompts)
    if cfg.model.lora:  # a fresh adapter is random: keep it, so that a resumed build samples the same policy
        torch.save({n: p.detach().cpu() for n, p in trainer.model.named_parameters() if "lora_" in n},
                   Path(cfg.output_dir) / "adapter.pt")
    policy = f"{cfg.model.name}{' + fresh LoRA' if cfg.model.lora else ''} (initial weights), batch sampled by fidelity build"
    return _estimate(a, cfg, trainer.model, trainer.tokenizer, saved, policy)


def _critic_methods() -> str:
    """The registered methods that declare a critic, as "a or b" (the registry's, not a list here)."""
    from ...credit.registry import get_method, list_methods

    return " or ".join(n for n in list_methods() if get_method(n).critic is not None)


def _critic_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tokencredit fidelity critic",
        description=f"evaluate the critic of a {_critic_methods()} run on an estimates file's batch and store it in the "
                    "file, so that `tokencredit fidelity` scores that method with its own run's critic")
    p.add_argument("estimates", help="the estimates file (updated in place, or written to -o)")
    p.add_argument("run", help=f"the run directory of a method with a critic ({_critic_methods()})")
    p.add_argument("--checkpoint", default=None, help="default: the run's latest checkpoint")
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    try:
        return _critic_from_run(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"tokencredit fidelity critic: {e}") from None


def _critic_from_run(a) -> int:
    from ...credit.spec import CreditPipeline

    if a.threads:
        torch.set_num_threads(a.threads)
    est = load_estimates(a.estimates, require_complete=False)
    run = Path(a.run)
    ck = Path(a.checkpoint) if a.checkpoint else RunFolder(run).latest()
    cfg, model, tok, head = _load_run(run, ck, critic=True)
    pipe = CreditPipeline(cfg.credit, cfg.method_configs())
    method = critic_method(pipe.name)
    if method is None:
        raise FidelityError(f"RUN: {run} trained {pipe.name!r}, which declares no critic; expected a run of {_critic_methods()}")
    from ...credit.registry import get_method

    spec = get_method(method).critic(pipe.configs[method])
    saved = est["rollouts"]
    _task_examples(cfg, saved)  # the same task's questions
    values = critic_values(model, head, tok, saved, sigmoid=spec.transform == "sigmoid")
    # how far this run's policy is from the one that sampled the batch (its critic is of that policy)
    diff = check_policy(model, tok, saved, cfg.rollout.temperature, tol=float("inf"))
    m = re.search(r"(\d+)$", ck.name) if ck is not None else None
    step = int(m.group(1)) if m else "?"
    source = (f"critic of a {pipe.name} run ({run.name}, step {step}) evaluated on this batch; that run's policy differs "
              f"from the batch's by {diff:.3f} nats/token")
    est = attach_critic(est, method, values, source)
    out = Path(a.output or a.estimates)
    atomic_save(est, out)
    print(f"{method}: {source}; written to {out}")
    return 0


def main(argv: Sequence[str]) -> int:
    """``tokencredit fidelity [FILE] [--json] ...``, ``tokencredit fidelity build RUN -o FILE ...`` (or
    ``build --task T -o FILE``) or ``tokencredit fidelity critic FILE RUN``."""
    argv = list(argv)
    if argv and argv[0] == "build":
        return _build_main(argv[1:])
    if argv and argv[0] == "critic":
        return _critic_main(argv[1:])
    return _score_main(argv)


def _build_exact(a) -> int:
    """``tokencredit fidelity build --task T --exact -o FILE``: the task's first ``--prompts``
    training examples, ``--samples`` responses each from the model restricted to the digits and
    its end token, exact V; written to ``a.output``."""
    import time

    from ...engine.models import EMBEDDED, load_frozen
    from ...data.tasks import make_task, score_safely

    if a.rollouts is not None or a.task is None:
        raise FidelityError("--exact: expected --task (the exact tier samples its own batch from the restricted policy), got ROLLOUTS")
    if a.lora or a.rows or a.crn:
        raise FidelityError("--exact: expected no --lora, --rows or --crn (every position of every response is exact)")
    out = Path(a.output)
    if out.exists() and not a.overwrite:
        raise FidelityError(f"-o: {str(out)!r} exists and an exact build does not resume; {_overwrite_hint(out)}")
    if a.threads:
        torch.set_num_threads(int(a.threads))
    task = make_task(a.task, seed=a.seed)
    examples = list(task.train)[: a.prompts]
    if a.overwrite:
        _start_again(out, task=False)
    name = a.model or EMBEDDED
    model, tok = load_frozen(name, field="--model")
    t0 = time.perf_counter()

    def reward(text, ex):
        r, _ = score_safely(task.reward, text, ex, 5.0)
        return r

    est = exact_estimates(model, tok, examples, reward, samples=a.samples, max_new_tokens=a.max_new_tokens,
                          temperature=a.temperature, seed=a.seed,
                          policy=f"{name} restricted to the digits and its end token, T = {a.temperature} (exact tier)")
    est["build"]["seconds"] = time.perf_counter() - t0
    atomic_save(est, out)
    print(f"exact estimates written to {a.output} ({est['build']['exact_nodes']} nodes, {est['build']['seconds']:.0f} s); "
          f"score them with: tokencredit fidelity {a.output}")
    return 0
