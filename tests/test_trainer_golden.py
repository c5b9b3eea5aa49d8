"""The trainer's output pinned: metrics, eval samples, saved rollouts and checkpoints of short runs.

Each case trains the tiny random Llama (one thread, fixed seeds) a few steps and reduces the run
folder to a digest: every ``metrics.jsonl`` row (timing fields left out, key order kept), the eval
samples, and for each ``.pt`` file (checkpoints, saved rollouts) the structure of its values with
each tensor's shape, dtype and sum. The digest must equal the one stored in
``tests/golden/trainer.json``: a change to what a step computes, the order of its parts, the
metrics it logs or what a checkpoint holds fails here.

The responses are replayed (``rollout.ReplayRollout``: token ids from an integer RNG, the same on
every machine), so no run depends on which token a float rounds to; sampling itself is pinned
elsewhere (test_models_rollout.py) and, byte for byte on one machine, by
``test_the_same_machine_gives_the_same_bytes_twice``. Floats compare to tolerances measured
across kernel sets (``TOL``), so a different CPU's rounding is no failure; token ids, shapes,
keys and every other value compare exactly.

The cases cover the step's every branch: the signal passes (policy, reference, adapter-off,
oracle, critic before and after the actor), stateful credit, several PPO epochs, the fused
one-pass update, DAPO's dynamic sampling, bf16 autocast, evaluation with saved rollouts, and a
run stopped and resumed (the resumed run's digest equals the uninterrupted one's).

Regenerate the file only for an intended change: ``python tests/test_trainer_golden.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tokencredit.engine.rollout import ReplayRollout
from tokencredit.train.config import (
    LogConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    apply_recipe,
)
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer

GOLDEN = Path(__file__).parent / "golden" / "trainer.json"


def golden_reward(completion: str, example) -> float:
    """Deterministic, and varies with the text, so that groups carry signal."""
    return float(zlib.crc32(completion.encode()) % 2)


def _cfg(out: Path, credit: str, steps: int, **kw) -> TrainConfig:
    cfg = TrainConfig(
        credit=credit, steps=steps, output_dir=str(out), threads=1, save_every=kw.pop("save_every", 1), keep_last=2,
        precision=kw.pop("precision", "fp32"),
        model=ModelConfig(name="tiny", lora=kw.pop("lora", False), lora_r=4, lora_alpha=8),
        task=TaskConfig(name="add1", n_train=8, n_eval=2, reward_fn="test_trainer_golden:golden_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, temperature=1.0),
        optim=OptimConfig(lr=1e-2, micro_batch_size=3, ppo_epochs=kw.pop("ppo_epochs", 1), one_pass=kw.pop("one_pass", True)),
        loss=kw.pop("loss", LossConfig()),
        log=LogConfig(eval_every=kw.pop("eval_every", 2), eval_samples=1, progress=False, eval_at_start=kw.pop("eval_at_start", False)),
        **kw,
    )
    return apply_recipe(cfg)


#: name -> (credit spec, steps, settings)
CASES = {
    "grpo_taco": ("grpo+taco", 3, {"eval_at_start": True}),
    "pact": ("pact", 2, {}),
    "gae": ("gae", 2, {"one_pass": False}),
    "oppo_stare": ("oppo+stare", 2, {}),
    "kl_two_epochs": ("grpo", 2, {"ppo_epochs": 2, "loss": LossConfig(kl_coef=0.1, agg_mode="seq-mean-token-mean")}),
    "arca_lora": ("arca", 2, {"lora": True}),
    "dapo": ("dapo", 2, {}),
    "bf16": ("grpo+taco", 2, {"precision": "bf16"}),
}


def _train(cfg: TrainConfig, sample: bool = False) -> Trainer:
    """Train ``cfg`` on the tiny model; the responses are replayed (``ReplayRollout``: the same
    token ids on every CPU), or sampled by HF generate when ``sample``."""
    model, tok = tiny_model_and_tokenizer(seed=0)
    tr = Trainer(cfg, model=model, tokenizer=tok, rollout=None if sample else ReplayRollout)
    tr.train()
    return tr


def _tensor(t: torch.Tensor, exact: bool):
    t = t.detach().cpu()
    out = {"shape": list(t.shape), "dtype": str(t.dtype)}
    if t.is_floating_point():
        out["sum"] = float(t.double().nan_to_num().sum())
        out["abs"] = float(t.double().nan_to_num().abs().sum())  # the scale a sum's rounding is relative to
    else:
        out["sum"] = int(t.long().sum())
    if exact:
        out["crc"] = zlib.crc32(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0
    return out


def _value(v, exact: bool):
    if isinstance(v, torch.Tensor):
        return _tensor(v, exact)
    if isinstance(v, dict):
        return {str(k): _value(x, exact) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_value(x, exact) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def digest(out: Path, exact: bool = False) -> dict:
    """The run folder ``out`` as plain values (see the module's doc); ``exact`` adds a checksum of
    every tensor's bytes (a refactoring's check on one machine)."""
    d = {}
    for p in sorted(out.rglob("*")):
        rel = str(p.relative_to(out))
        if p.is_dir() or rel.startswith(".lock"):
            continue
        if p.name == "metrics.jsonl":
            d[rel] = [[[k, v] for k, v in json.loads(line).items() if not (k.startswith("time/") or k == "step_time")]
                      for line in p.read_text().splitlines()]
        elif p.suffix == ".jsonl":
            d[rel] = [json.loads(line) for line in p.read_text().splitlines()]
        elif p.suffix == ".pt":
            d[rel] = _value(torch.load(p, weights_only=False), exact)
            if isinstance(d[rel].get("config"), dict):
                d[rel]["config"].pop("output_dir")  # where the run was, not what it computed
                # Python's own RNG: checkpointed, but the trainer neither seeds nor draws from it
                d[rel]["rng"]["python"] = sorted(d[rel]["rng"]["python"])
        elif p.name == "config.json":
            d[rel] = json.loads(p.read_text())
            d[rel].pop("output_dir")
        elif p.suffix == ".sha256":  # a checksum of the checkpoint's bytes: that it is there
            d[rel] = "sha256"
        else:
            d[rel] = zlib.crc32(p.read_bytes())
    return d


def run_case(name: str, root: Path, exact: bool = False, sample: bool = False) -> dict:
    credit, steps, kw = CASES[name]
    out = root / name
    _train(_cfg(out, credit, steps, **dict(kw)), sample=sample)
    return digest(out, exact)


#: (tensor, scalar) tolerances. A tensor's sum compares to ``tensor`` times the sum of its
#: absolute values (the scale its rounding is relative to), a metric to ``scalar`` relative (1e-3
#: floor on the scale). Measured: the pinned runs under ATEN_CPU_CAPABILITY=avx512 (this Intel
#: Xeon's default, AMX bf16), avx2, default and avx2 + MKL_ENABLE_INSTRUCTIONS=AVX2 +
#: ONEDNN_MAX_CPU_ISA=AVX2 (an AVX2-only CPU's kernels) differ by at most 1.5e-5 (tensors) and
#: 1.6e-4 (metrics) in fp32, and by 6.0e-3 and 2.3e-3 in bf16, whose matrix products round
#: differently on AMX than on AVX2 (docs/training.md, "Pinned outputs"); each tolerance is 10x that.
TOL = {"fp32": (1.5e-4, 1.6e-3), "bf16": (6e-2, 2.3e-2)}
#: the rollout-correction metrics (``rollout_corr/*``) measure the mismatch between the sampler's
#: numerics and the update's: in bf16 their value IS rounding noise (log-ratios of ~1e-4), so a
#: relative tolerance means nothing. Measured across the same kernel sets: log_ratio_mean and kl
#: move by up to 4.9e-5, log_ratio_max by 2.0e-5, log_ratio_min by 1.0e-5, k3_kl by 2.7e-8 (the
#: masked fractions not at all); they compare to an absolute 10x the largest, in log-ratio units.
MISMATCH_ABS = 5e-4


def _is_mismatch_metric(want) -> bool:
    return (isinstance(want, list) and len(want) == 2 and isinstance(want[0], str)
            and want[0].startswith("rollout_corr/") and isinstance(want[1], float))


def _is_tensor(d) -> bool:
    return isinstance(d, dict) and set(d) >= {"shape", "dtype", "sum", "abs"}


def _close(got, want, where: str = "", tol=TOL["fp32"]) -> None:
    """``got == want`` up to ``tol`` (see TOL): structure, keys, strings, integers, shapes and
    dtypes exactly; an AssertionError names the first place they differ."""
    t_tol, s_tol = tol
    if _is_tensor(want):
        assert _is_tensor(got), f"{where}: {got!r} != {want!r}"
        for k in want:
            if k in ("sum", "abs") and isinstance(want[k], float):
                assert abs(got[k] - want[k]) <= t_tol * max(want["abs"], 1e-12), f"{where}/{k}: {got[k]!r} != {want[k]!r} (scale {want['abs']:.4g})"
            else:
                assert got[k] == want[k], f"{where}/{k}: {got[k]!r} != {want[k]!r}"
    elif isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        assert got == want or abs(got - want) <= s_tol * max(abs(want), 1e-3), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys {list(got) if isinstance(got, dict) else got} != {list(want)}"
        for k in want:
            _close(got[k], want[k], f"{where}/{k}", tol)
    elif _is_mismatch_metric(want):
        assert isinstance(got, list) and got[0] == want[0], f"{where}: {got!r} != {want!r}"
        assert abs(got[1] - want[1]) <= MISMATCH_ABS, f"{where}: {got!r} != {want!r} (absolute {MISMATCH_ABS})"
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]", tol)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _tol(name: str):
    return TOL[CASES[name][2].get("precision", "fp32")]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The cases train on one thread (``threads=1`` sets torch's for the process); later tests
    get the count back (a run in a child process compares with one in this process)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _stored() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_a_run_reproduces_its_pinned_output(tmp_path, name):
    want = _stored()[name]
    got = json.loads(json.dumps(run_case(name, tmp_path)))  # as stored: tuples are lists
    _close(got, want, name, _tol(name))


def test_the_same_machine_gives_the_same_bytes_twice(tmp_path):
    """Sampling by HF generate (not replayed): two runs of a case on one machine write the same
    bytes (every tensor's checksum), so a run is reproducible where it ran."""
    a = run_case("oppo_stare", tmp_path / "a", exact=True, sample=True)
    b = run_case("oppo_stare", tmp_path / "b", exact=True, sample=True)
    assert a == b


def test_the_tolerances_still_see_a_changed_step(tmp_path):
    """The tolerant comparison fails on a run that computes something else (the learning rate
    10% lower): the tolerances are far below what a change to the step moves."""
    credit, steps, kw = CASES["grpo_taco"]
    cfg = _cfg(tmp_path / "lr", credit, steps, **dict(kw))
    _train(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.9e-2)))
    got = json.loads(json.dumps(digest(tmp_path / "lr")))
    want = _stored()["grpo_taco"]
    weights = [k for k in want if k.endswith("state.pt")]  # the trained weights only
    assert weights and all(k in got for k in weights)
    with pytest.raises(AssertionError, match="sum|abs"):
        _close({k: got[k]["model"] for k in weights}, {k: want[k]["model"] for k in weights}, "grpo_taco lr 0.009")


def test_the_mismatch_metrics_compare_absolutely():
    """rollout_corr/* within MISMATCH_ABS of the pinned value pass whatever their relative change
    (cross-kernel rounding noise); a mismatch of the size a real one has (1e-3 in log-ratio) fails."""
    want = [["rollout_corr/log_ratio_mean", 1.2e-4], ["loss", 0.5]]
    _close([["rollout_corr/log_ratio_mean", 1.6e-4], ["loss", 0.5]], want, "noise", TOL["bf16"])
    with pytest.raises(AssertionError, match="rollout_corr/log_ratio_mean"):
        _close([["rollout_corr/log_ratio_mean", 1.2e-3], ["loss", 0.5]], want, "moved", TOL["bf16"])
    with pytest.raises(AssertionError, match="loss"):  # other metrics keep their relative tolerance
        _close([["rollout_corr/log_ratio_mean", 1.2e-4], ["loss", 0.52]], want, "loss", TOL["bf16"])


def test_a_stopped_and_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    """grpo_taco stopped after step 2 of 3 and resumed: the same folder as the pinned run (the
    checkpoints and metrics of a run trained in one go), up to the settings that say so."""
    credit, steps, kw = CASES["grpo_taco"]
    out = tmp_path / "grpo_taco"
    _train(_cfg(out, credit, 2, **dict(kw)))
    _train(_cfg(out, credit, steps, resume=True, **dict(kw)))
    got = json.loads(json.dumps(digest(out)))
    want = _stored()["grpo_taco"]
    for d in (got, want):  # the config says resume: true, and the first run's checkpoint says steps: 2
        for k, v in d.items():
            if k.endswith("config.json"):
                v.pop("resume")
            elif k.endswith("state.pt"):
                v["config"].pop("resume")
                v["config"].pop("steps")
    _close(got, want, "grpo_taco resumed", _tol("grpo_taco"))


if __name__ == "__main__":  # regenerate tests/golden/trainer.json (an intended change only)
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    exact = "--exact" in sys.argv
    dest = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else GOLDEN
    with tempfile.TemporaryDirectory() as tmp:
        res = {name: run_case(name, Path(tmp), exact) for name in CASES}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, separators=(",", ":")) + "\n")
    print(f"wrote {dest}")
