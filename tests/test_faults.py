"""A run killed anywhere resumes to the same result (issue 21).

A run is killed at a point hypothesis chooses -- between steps, half-way through a step,
inside a checkpoint write, inside a metrics.jsonl write (part of the bytes written) -- and
continued with ``--resume`` (or started again with ``--overwrite`` when the kill came before
its first checkpoint). The final weights must equal the uninterrupted run's exactly, and
metrics.jsonl must hold every step once, with the same values (timings aside).

The kill is deterministic: a hook at the Nth call of the write (or step) raises ``Killed``, a
BaseException that nothing in the trainer catches, so the files are left as a kill leaves
them (the lock and file descriptors are released by the ``finally`` blocks as the kernel
releases them for a dead process). One test kills a real child process with SIGKILL inside a
metrics write, to show that the in-process kill leaves nothing a real one would not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokencredit.train.checkpoint import _CheckpointFile, latest_checkpoint
from tokencredit.train.config import (
    LogConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)
from tokencredit.train.runfolder import MetricsWriter
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer

STEPS = 3


def crc_reward(completion: str, example) -> float:
    return float(zlib.crc32(completion.encode()) % 2)


class Killed(BaseException):
    """The process dies here (nothing catches a BaseException that is not KeyboardInterrupt)."""


def _cfg(out: Path, **kw) -> TrainConfig:
    return TrainConfig(
        credit="grpo", steps=STEPS, output_dir=str(out), save_every=2, keep_last=2,
        model=ModelConfig(name="tiny"),
        task=TaskConfig(name="add1", n_train=16, n_eval=2, reward_fn="test_faults:crc_reward"),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4, temperature=1.0),
        optim=OptimConfig(lr=1e-2, micro_batch_size=4),
        log=LogConfig(eval_every=STEPS, eval_samples=1, progress=False, eval_at_start=True, save_rollouts=False),
        **kw,
    )


def _train(cfg: TrainConfig) -> Trainer:
    model, tok = tiny_model_and_tokenizer(seed=0)
    tr = Trainer(cfg, model=model, tokenizer=tok)
    tr.train()
    return tr


def _weights(tr: Trainer):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


def _rows(out: Path):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time/") or k == "step_time")} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    tr = _train(_cfg(out))
    return _weights(tr), _rows(out)


def _resume(out: Path) -> Trainer:
    """What a user does after the kill: --resume, or --overwrite when no checkpoint was written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a repaired torn line, a skipped damaged checkpoint: said, expected here
        if latest_checkpoint(out / "checkpoints") is None:
            return _train(_cfg(out, overwrite=True))
        return _train(_cfg(out, resume=True))


def _assert_same(tr: Trainer, out: Path, reference) -> None:
    weights, rows = reference
    got = _weights(tr)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert _rows(out) == rows
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]  # nothing half-written left


# -- the kill points ------------------------------------------------------------------------------


def _kill_between_steps(monkeypatch, n: int, cut: float) -> None:
    real, calls = Trainer.train_step, {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == n:
            raise Killed
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)


def _kill_inside_a_step(monkeypatch, n: int, cut: float) -> None:
    real, calls = Trainer._update_policy, {"n": 0}

    def update(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == n:  # the rollouts are done, the data position and RNG have moved
            raise Killed
        return real(self, *a, **k)

    monkeypatch.setattr(Trainer, "_update_policy", update)


def _kill_inside_a_metrics_write(monkeypatch, n: int, cut: float) -> None:
    real, calls = MetricsWriter._write_bytes, {"n": 0}

    def write(self, data: bytes):
        calls["n"] += 1
        if calls["n"] == n:
            real(self, data[: int(len(data) * cut)])  # part of the line reached the file
            raise Killed
        return real(self, data)

    monkeypatch.setattr(MetricsWriter, "_write_bytes", write)


def _kill_inside_a_checkpoint_write(monkeypatch, n: int, cut: float) -> None:
    """At the nth checkpoint, after a fraction ``cut`` of its bytes reached the file. (The kill
    comes from Python, after torch.save: raised inside torch's own writer, torch would turn it
    into a RuntimeError that the save then cleans up after, which a real kill never does.)"""
    import io

    real, calls = torch.save, {"n": 0}

    def save(obj, f, *a, **k):
        if not isinstance(f, _CheckpointFile):
            return real(obj, f, *a, **k)
        calls["n"] += 1
        if calls["n"] != n:
            return real(obj, f, *a, **k)
        buf = io.BytesIO()
        real(obj, buf, *a, **k)
        f.write(buf.getvalue()[: int(len(buf.getvalue()) * cut)])
        raise Killed

    monkeypatch.setattr(torch, "save", save)


# (kill point, how many times it happens in the uninterrupted run): steps 1-3; the metrics
# writes are the step-0 eval and steps 1-3; checkpoints at steps 2 and 3
KILLS = {
    "between_steps": (_kill_between_steps, STEPS),
    "inside_a_step": (_kill_inside_a_step, STEPS),
    "inside_a_metrics_write": (_kill_inside_a_metrics_write, STEPS + 1),
    "inside_a_checkpoint_write": (_kill_inside_a_checkpoint_write, 2),
}


@st.composite
def kill_points(draw):
    kind = draw(st.sampled_from(sorted(KILLS)))
    n = draw(st.integers(1, KILLS[kind][1]))
    cut = draw(st.sampled_from([0.0, 0.3, 0.5, 0.99]))
    return kind, n, cut


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(point=kill_points())
# every kind once, past the first checkpoint (step 2), whatever hypothesis draws besides
@example(point=("between_steps", 3, 0.0))
@example(point=("inside_a_step", 3, 0.0))
@example(point=("inside_a_metrics_write", 4, 0.5))
@example(point=("inside_a_checkpoint_write", 2, 0.5))
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path_factory, reference, point):
    kind, n, cut = point
    out = tmp_path_factory.mktemp("killed") / "run"
    with pytest.MonkeyPatch.context() as mp:
        KILLS[kind][0](mp, n, cut)
        with pytest.raises(Killed):  # the drawn point is reached (else this fails)
            _train(_cfg(out))
    _assert_same(_resume(out), out, reference)


# -- a real SIGKILL in a child process ------------------------------------------------------------


def _child(out: str, n: int) -> None:
    """Run in a child process: the run, SIGKILLed half-way through its nth metrics line."""
    real = MetricsWriter._write_bytes
    calls = {"n": 0}

    def write(self, data: bytes):
        calls["n"] += 1
        if calls["n"] == n:
            real(self, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, data)

    MetricsWriter._write_bytes = write
    _train(_cfg(Path(out)))


def test_a_sigkill_inside_a_metrics_write_resumes_to_the_same_result(tmp_path, reference):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent)] + sys.path))
    child = subprocess.run([sys.executable, "-c", f"import test_faults; test_faults._child({str(out)!r}, 4)"],
                           env=env, capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not (out / "metrics.jsonl").read_bytes().endswith(b"\n")  # the kill tore step 3's line
    assert latest_checkpoint(out / "checkpoints").name == "step_00000002"  # so --resume reads the torn file
    _assert_same(_resume(out), out, reference)
