"""Build the bundled credit-fidelity reference set (src/tokencredit/data/fidelity_reference.pt).

    .venv/bin/python scripts/build_fidelity_set.py                   # the shipped set
    .venv/bin/python scripts/build_fidelity_set.py --max-minutes 20  # stop (resumably)

1. A short LoRA run of the embedded SmolLM2-135M-Instruct on the multi-step task ``chain``
   (credit ``pact``: PACT's actor is GRPO's policy gradient with a learned baseline, and its
   critic is what gae / pact are scored with), so that the adapter residual, the divergence
   from the adapter-off reference, the oracle pass and every other signal are non-trivial.
2. One more batch (``--prompts`` x ``--samples`` responses) from the policy as the run left
   it: the trainer's own step with the learning rate set to 0 (the weights are checked to be
   unchanged), so the batch carries every signal and the credit state exactly as a run saves
   them (``Trainer.save_rollouts``).
3. Monte Carlo ``V(h_t)`` at every ``--stride``-th position, ``-M`` continuations each, from
   that same policy (``tokencredit.analysis.fidelity.build_estimates``), with the shared-prefix KV
   cache; the first ``--baseline-batches`` batches are also run with plain ``generate`` for
   the throughput figure.

Everything is written under ``--work-dir`` as it goes (the run, the batch, the adapter
weights), so a rerun resumes the estimates where they stopped. The cost is printed at the end
and kept in the file (``build``); docs/fidelity.md has the numbers of the shipped set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "src" / "tokencredit" / "data" / "fidelity_reference.pt"


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=str(DEFAULT_OUT))
    p.add_argument("--work-dir", default=str(ROOT / "build" / "fidelity_set"))
    p.add_argument("--task", default="chain")
    p.add_argument("--credit", default="pact")
    p.add_argument("--steps", type=int, default=4, help="LoRA training steps before the batch")
    p.add_argument("--train-prompts", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16, help="prompts of the scored batch")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("-M", type=int, default=16)
    p.add_argument("--stride", type=int, default=4)
    # 128 rows (8 prefixes x M 16) per generate call: on the 2-core CPU one decode step of 256
    # rows took 6.9 s against 0.41 s for 128 (docs/fidelity.md)
    p.add_argument("--rows-per-batch", type=int, default=128)
    p.add_argument("--baseline-batches", type=int, default=1)
    # 1: on the shared 2-core machine, 2 torch threads made one LoRA training step take > 6 min
    # instead of 28 s (threads spinning on each other under oversubscription; docs/fidelity.md)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--rollouts-from", default=None,
                   help="take the scored batch from this estimates file instead of sampling one (the policy is retrained "
                        "with the same settings and checked against the batch's behaviour log-probs): e.g. the per-token set "
                        "of the bundled batch")
    p.add_argument("--rows", default="all",
                   help="which responses to estimate: all, mixed (the prompt groups with both outcomes, where "
                        "group-relative methods give credit), mixed:N (the first N such groups) or comma-separated indices")
    p.add_argument("--sampler", default="multinomial", choices=("multinomial", "inverse_cdf"),
                   help="the training rollouts' sampler (rollout.sampler): the bundled sets' policies were trained "
                        "with multinomial, so --rollouts-from reproduces their policy only with it")
    p.add_argument("--crn", action="store_true",
                   help="common random numbers: continuation m of every prefix of a response shares its sampling noise "
                        "(docs/fidelity.md); the bundled per-token CRN set is built with it")
    p.add_argument("--critic-runs", default=None,
                   help="instead of building: train a run of each of these methods with a critic (comma-separated, "
                        "e.g. gae) with the same settings and seed, and store its critic evaluated on the batch of "
                        "--output in that file (`tokencredit fidelity critic`), so the method is scored with its own run's critic")
    return p.parse_args()


def train_config(a, credit: str, output_dir: Path):
    from tokencredit.train.config import (
        LogConfig,
        ModelConfig,
        OptimConfig,
        RolloutConfig,
        TaskConfig,
        TrainConfig,
    )

    return TrainConfig(
        credit=credit, steps=a.steps, seed=a.seed, threads=a.threads, output_dir=str(output_dir),
        model=ModelConfig(lora=True),
        task=TaskConfig(name=a.task, n_eval=8),
        rollout=RolloutConfig(prompts_per_step=a.train_prompts, samples_per_prompt=a.samples,
                              max_new_tokens=a.max_new_tokens, temperature=a.temperature, sampler=a.sampler),
        optim=OptimConfig(lr=a.lr, micro_batch_size=16),
        log=LogConfig(eval_every=10_000, eval_samples=0, eval_at_start=False, progress=True),
    )


def critic_runs(a, work: Path) -> int:
    """Train a run of each ``--critic-runs`` method and attach its critic to ``--output``."""
    from tokencredit.analysis import fidelity
    from tokencredit.train.checkpoint import latest_checkpoint
    from tokencredit.train.trainer import Trainer

    for credit in a.critic_runs.split(","):
        run = work / f"run_{credit}"
        t0 = time.perf_counter()
        if latest_checkpoint(run / "checkpoints") is None:
            Trainer(train_config(a, credit, run)).train()
        print(f"{credit} run: {time.perf_counter() - t0:.0f} s", flush=True)
        fidelity.main(["critic", a.output, str(run)])
    print(fidelity.format_table(fidelity.score(fidelity.load_estimates(a.output))))
    return 0


def chosen_rows(spec: str, saved) -> list:
    """The response indices ``--rows`` names."""
    from tokencredit.analysis.fidelity import mixed_groups

    groups = torch.as_tensor(saved["signals"]["group_ids"]).tolist()
    if spec == "all":
        return list(range(len(groups)))
    if spec.startswith("mixed"):
        rows = mixed_groups(saved, range(len(groups)))
        if ":" in spec:  # the first N such groups, in batch order
            keep = set(list(dict.fromkeys(groups[b] for b in rows))[: int(spec.split(":", 1)[1])])
            rows = [b for b in rows if groups[b] in keep]
        return rows
    return [int(x) for x in spec.split(",")]


def main() -> int:
    a = parse()
    torch.set_num_threads(a.threads)
    from tokencredit.analysis.fidelity import (
        build_estimates,
        format_table,
        load_estimates,
        sample_batch,
        score,
    )
    from tokencredit.data.tasks import score_safely
    from tokencredit.train.trainer import Trainer

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.critic_runs:
        return critic_runs(a, work)
    cfg = train_config(a, a.credit, work / "run")
    trainer = Trainer(cfg)
    rollouts, policy = work / "rollouts.pt", work / "policy.pt"
    if rollouts.exists() and policy.exists():
        sd = torch.load(policy, map_location="cpu", weights_only=True)
        params = dict(trainer.model.named_parameters())
        with torch.no_grad():
            for n, v in sd.items():
                params[n].copy_(v)
        saved = torch.load(rollouts, map_location="cpu", weights_only=True)
        print(f"resuming from {rollouts}", flush=True)
        train_s = float(json.loads((work / "cost.json").read_text())["train_s"])
    elif a.rollouts_from:
        # the batch of an existing estimates file, sampled by the policy this run retrains;
        # build_estimates' check_policy refuses it if the retrained policy is not that one
        trainer.train()
        saved = load_estimates(a.rollouts_from, require_complete=False)["rollouts"]
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}, policy)
        torch.save(saved, rollouts)
        train_s = time.perf_counter() - t0
        (work / "cost.json").write_text(json.dumps({"train_s": train_s}))
    else:
        trainer.train()
        # one more step at lr 0: the trainer's own batch, signals and credit, weights unchanged
        saved = sample_batch(trainer, a.prompts)
        torch.save(saved, rollouts)
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}, policy)
        train_s = time.perf_counter() - t0
        (work / "cost.json").write_text(json.dumps({"train_s": train_s}))
    task = trainer.task
    by_q = {e.question: e for e in list(task.train) + list(task.eval)}
    exs = [by_q[q] for q in saved["questions"]]
    saved = dict(saved, messages=[list(e.messages) for e in exs])

    def reward(text, b):
        return score_safely(task.reward, text, exs[b], cfg.task.reward_timeout_s)

    # The continuations are sampled from the adapter merged into a copy of the weights (the same
    # policy up to float rounding, which check_policy verifies against the batch's behaviour
    # log-probs; ~15% faster than the unmerged peft model on CPU)
    sampling_model = trainer.model
    if hasattr(sampling_model, "merge_and_unload"):
        import copy

        sampling_model = copy.deepcopy(sampling_model).merge_and_unload()
    est = build_estimates(
        saved, sampling_model, trainer.tokenizer, reward, a.output, M=a.M, stride=a.stride, temperature=a.temperature,
        max_new_tokens=a.max_new_tokens, rows_per_batch=a.rows_per_batch, seed=a.seed,
        baseline_batches=a.baseline_batches, crn=a.crn,
        policy=f"SmolLM2-135M-Instruct + LoRA after {a.steps} steps of {a.credit} on {a.task} (lr {a.lr})",
        max_seconds=None if a.max_minutes is None else a.max_minutes * 60, rows=chosen_rows(a.rows, saved),
    )
    est["build"]["train_s"] = train_s
    est["build"]["threads"] = a.threads
    est["build"]["rows_per_batch"] = a.rows_per_batch
    torch.save(est, a.output)
    b = est["build"]
    print(json.dumps({k: v for k, v in b.items()}, indent=1, default=str))
    if b.get("baseline"):
        bl = b["baseline"]
        print(f"throughput: shared prefix {bl['shared_tokens'] / bl['shared_s']:.1f} tok/s, "
              f"plain generate {bl['plain_tokens'] / bl['plain_s']:.1f} tok/s on the same {bl['batches']} batch(es)")
    try:
        print(format_table(score(load_estimates(a.output))))
    except ValueError as e:
        print(f"not scored yet: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
