"""Checkpoints, final/ and exports that are checked, never trusted (issue 29, findings 2, 3, 11).

* A checkpoint carries a sha256 of its bytes (``state.pt.sha256``): bytes changed in place are
  found on resume (the previous intact checkpoint is used, with a warning) and on export (one
  line, exit 2). Weights are checked against the model (every key, shape and dtype: a scalar
  never broadcasts into a matrix, a missing weight is named) and must be finite, at save and
  at load.
* ``final/`` is written to a temporary sibling, checked (its files and their checksums) and
  renamed; a ``--resume`` of a finished run whose ``final/`` is missing, incomplete or of
  another step writes it again from the last checkpoint.
* ``export --to`` an existing file, two exports to one ``--to``, a full disk in ``export`` and
  ``fidelity build``: one line each, and no temporary file left.
* A run killed before its first checkpoint: the refusals offer ``--overwrite`` (and not a
  ``--resume`` that cannot work).

Each test failed on the code before issue 29 (each was run against it once).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import warnings
from pathlib import Path

import pytest
import torch

from tokencredit.train.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from tokencredit.train.export import ExportError, export_run
from tokencredit.testing import tiny_model_and_tokenizer
from tokencredit.train.trainer import Trainer

from test_reliability import TINY_FLAGS, _cfg, _cli, _trainer, tiny_cli  # noqa: F401  (tiny_cli: a fixture)

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


class Killed(BaseException):
    """The process dies here (nothing catches a BaseException that is not KeyboardInterrupt)."""


def _run(tmp_path, steps=2, **kw) -> Path:
    out = tmp_path / "run"
    _trainer(_cfg(out, "grpo", steps=steps, **kw)).train()
    return out


def _ck(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def _rewrite(ck: Path, change) -> None:
    """Change a checkpoint's state and save it the way tokencredit saves one (a valid checksum):
    what another tool, or a bug, could write."""
    state = torch.load(ck / "state.pt", weights_only=True)
    change(state)
    step = int(ck.name[5:])
    save_checkpoint(ck.parent, step, state, keep_last=10)


def _stdout_and_cli(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code, err = _cli(argv)
    return code, out.getvalue(), err


def _no_tmp(root: Path):
    return [str(p) for p in root.rglob("*") if ".tmp" in p.name]


# -- finding 2: damaged checkpoints are found, on resume and on export --------------------------


def test_bytes_changed_in_place_fail_the_checksum_on_resume_and_export(tmp_path, tiny_cli):
    out = _run(tmp_path, steps=2)
    f = _ck(out, 2) / "state.pt"
    state = torch.load(f, weights_only=True)
    data = f.read_bytes()
    raw = state["model"][Q_PROJ].numpy().tobytes()
    at = data.find(raw[:64])
    assert at > 0
    f.write_bytes(data[:at] + bytes(64) + data[at + 64:])  # same size, 16 weights zeroed
    damaged = torch.load(f, weights_only=True)  # torch itself loads it: the damage is silent there
    assert not torch.equal(damaged["model"][Q_PROJ], state["model"][Q_PROJ])
    with pytest.raises(CheckpointError, match=r"step_00000002.*sha256"):
        load_checkpoint(_ck(out, 2))
    # export: a one-line refusal naming the file, never the damaged weights
    code, err = _cli(["export", str(out), "--to", str(tmp_path / "exp")])
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.startswith("tokencredit export: checkpoint ") and "step_00000002" in err and "sha256" in err
    assert "--checkpoint 1" in err and not (tmp_path / "exp").exists()
    # resume: the previous intact checkpoint, with a warning naming the damaged one
    tr = _trainer(_cfg(out, "grpo", steps=3, resume=True))
    with pytest.warns(CheckpointWarning, match=r"step_00000002.*sha256"):
        tr.train()
    assert tr.step == 3
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1.0, 2.0, 3.0]


def test_a_tensor_replaced_by_a_scalar_is_refused_never_broadcast(tmp_path, tiny_cli):
    out = _run(tmp_path, steps=2)
    _rewrite(_ck(out, 2), lambda s: s["model"].__setitem__(Q_PROJ, torch.tensor(0.0)))
    bad = torch.load(_ck(out, 2) / "state.pt", weights_only=True)
    shape = tuple(torch.load(_ck(out, 1) / "state.pt", weights_only=True)["model"][Q_PROJ].shape)
    want = f"model weight {Q_PROJ!r}: expected a float32 tensor of shape {shape}, got a float32 tensor of shape ()"
    code, err = _cli(["export", str(out), "--to", str(tmp_path / "exp")])
    assert code == 2 and err.strip().count("\n") == 0, err
    assert want in err and "step_00000002" in err and not (tmp_path / "exp").exists()
    with pytest.raises(CheckpointError, match=r"step_00000002"):
        export_run(str(out), str(tmp_path / "exp"), checkpoint=2)
    # fidelity's run loader (fidelity build/score RUN --checkpoint): refused, never broadcast
    from tokencredit.analysis.fidelity.cli import FidelityError, _load_run

    with pytest.raises(FidelityError, match=r"expected a float32 tensor of shape"):
        _load_run(out, _ck(out, 2))
    # resume: step 2 is refused with a warning, step 1 is used, and no weight is all zeros
    tr = _trainer(_cfg(out, "grpo", steps=2, resume=True))
    with pytest.warns(CheckpointWarning, match=r"step_00000002.*expected a float32 tensor"):
        tr.train()
    q = dict(tr.model.named_parameters())[Q_PROJ]
    assert q.abs().sum() > 0
    # eval --run and a direct load_state_dict: refused the same way (no copy_ broadcast)
    with pytest.raises(CheckpointError, match=r"expected a float32 tensor of shape"):
        tr.load_state_dict(bad)


def test_a_checkpoint_missing_a_weight_is_refused_naming_it(tmp_path, tiny_cli):
    out = tmp_path / "run"
    assert _cli(["train", "--steps", "1", "--output-dir", str(out)] + TINY_FLAGS)[0] == 0
    _rewrite(_ck(out, 1), lambda s: s["model"].pop(Q_PROJ))
    code, err = _cli(["export", str(out), "--to", str(tmp_path / "exp")])
    assert code == 2 and err.strip().count("\n") == 0, err
    assert f"model weight {Q_PROJ!r}: expected a float32 tensor of shape" in err and "got none" in err
    assert not (tmp_path / "exp").exists()
    # resume: one line naming the key (before: a KeyError traceback)
    code, err = _cli(["train", "--steps", "2", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.startswith("tokencredit train: checkpoint: every checkpoint under") and repr(Q_PROJ) in err and "got none" in err


def test_non_finite_weights_are_never_saved_and_a_non_finite_checkpoint_is_not_the_last_good_one(tmp_path, tiny_cli):
    from tokencredit.train.update import NonFiniteError

    out = _run(tmp_path, steps=1)
    state = torch.load(_ck(out, 1) / "state.pt", weights_only=True)
    bad = dict(state, step=2, model=dict(state["model"]))
    bad["model"][Q_PROJ] = bad["model"][Q_PROJ].clone()
    bad["model"][Q_PROJ][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=rf"checkpoint of step 2 not written: model weight {Q_PROJ!r} holds 1 non-finite"):
        save_checkpoint(out / "checkpoints", 2, bad)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]  # no step 2, no temporary
    # one written without the check (by hand, with its checksum): refused at load
    ck2 = _ck(out, 2)
    ck2.mkdir()
    torch.save(bad, ck2 / "state.pt")
    (ck2 / "state.pt.sha256").write_text(hashlib.sha256((ck2 / "state.pt").read_bytes()).hexdigest() + "  state.pt\n")
    with pytest.raises(CheckpointError, match=rf"model weight {Q_PROJ!r}: expected finite values, got 1 NaN or inf"):
        load_checkpoint(ck2)
    with pytest.warns(CheckpointWarning, match="step_00000002.*finite"):
        ck, _ = load_latest_checkpoint(out / "checkpoints")
    assert ck == _ck(out, 1)
    code, err = _cli(["export", str(out), "--to", str(tmp_path / "exp")])
    assert code == 2 and "expected finite values" in err and err.strip().count("\n") == 0


# -- finding 3: final/ written atomically, checked, rewritten on resume ------------------------


def _final_equals_checkpoint(final: Path, ck: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    weights = torch.load(ck / "state.pt", weights_only=True)["model"]
    params = dict(m.named_parameters())
    assert all(torch.equal(params[n].detach(), v) for n, v in weights.items())


def test_a_kill_during_the_final_export_leaves_no_final_and_resume_writes_it(tmp_path, tiny_cli, monkeypatch):
    from transformers import PreTrainedModel

    out = tmp_path / "run"
    assert _cli(["train", "--steps", "1", "--output-dir", str(out)] + TINY_FLAGS)[0] == 0  # final/ of step 1
    real = PreTrainedModel.save_pretrained

    def killed(self, path, *a, **k):
        Path(path).mkdir(parents=True, exist_ok=True)  # as save_pretrained does first
        raise Killed

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(Killed):
        _cli(["train", "--steps", "2", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert json.loads((out / "final" / "tokencredit_export.json").read_text())["step"] == 1  # the old one, whole
    assert _no_tmp(tmp_path) == []
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    # the run is at step 2, final/ holds step 1: --resume says so and writes step 2's
    code, stdout, err = _stdout_and_cli(["train", "--steps", "2", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 0, err
    assert "holds step 1, not step 2" in stdout and f"nothing to train: the run is at step 2 of 2" in stdout
    _final_equals_checkpoint(out / "final", _ck(out, 2))
    # an empty final/ (what a kill left before issue 29): written again, never reported as the model
    for p in (out / "final").iterdir():
        p.unlink()
    code, stdout, err = _stdout_and_cli(["train", "--steps", "2", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 0, err
    assert f"{out / 'final'}: incomplete" in stdout and "written again from the checkpoint of step 2" in stdout
    _final_equals_checkpoint(out / "final", _ck(out, 2))
    # a weight file changed after it was written: its checksum says so
    f = out / "final" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-8:] = bytes(8)
    f.write_bytes(bytes(data))
    code, stdout, err = _stdout_and_cli(["train", "--steps", "2", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 0 and "model.safetensors differs from its sha256" in stdout, stdout + err
    _final_equals_checkpoint(out / "final", _ck(out, 2))
    assert _no_tmp(tmp_path) == []


def test_a_full_disk_during_the_final_export_is_one_line_and_resume_writes_final(tmp_path, tiny_cli, monkeypatch):
    import transformers.modeling_utils as mu

    real = mu.safe_save_file

    def full(tensors, filename, *a, **k):  # part of the file, then the disk is full
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mu, "safe_save_file", full)
    out = tmp_path / "run"
    code, err = _cli(["train", "--steps", "1", "--output-dir", str(out)] + TINY_FLAGS)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"tokencredit train: final model of step 1: no space left on device writing {str(out / 'final')!r} (No space "
        f"left on device); the checkpoint of step 1 is intact: free space and run again with --resume to write it")
    assert not (out / "final").exists() and _no_tmp(tmp_path) == []
    monkeypatch.setattr(mu, "safe_save_file", real)
    code, stdout, err = _stdout_and_cli(["train", "--steps", "1", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 0 and f"final model in {out / 'final'}" in stdout, stdout + err
    _final_equals_checkpoint(out / "final", _ck(out, 1))


# -- finding 11: export --to, two exports at once, a full disk; a run killed early ---------------


def test_export_to_an_existing_file_is_one_line(tmp_path, tiny_cli):
    out = _run(tmp_path, steps=1)
    target = tmp_path / "model.bin"
    target.write_text("keep me")
    code, err = _cli(["export", str(out), "--to", str(target)])
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.strip() == f"tokencredit export: --to: expected a new or empty folder, got {str(target)!r}, which is a file"
    assert target.read_text() == "keep me"


def test_two_exports_to_one_folder_cannot_interleave(tmp_path, tiny_cli, monkeypatch):
    """The second export starts while the first is writing (inside its save_pretrained): one of
    them wins whole, the other is refused in one line, and nothing half-written is left."""
    from transformers import PreTrainedModel

    out = _run(tmp_path, steps=2)
    to = tmp_path / "exp"
    real, inner = PreTrainedModel.save_pretrained, {}

    def save_and_race(self, path, *a, **k):
        real(self, path, *a, **k)
        if not inner:
            inner["started"] = True
            inner["path"] = export_run(str(out), str(to), checkpoint=2)  # a second export, to the same --to

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_and_race)
    with pytest.raises(ExportError) as ei:
        export_run(str(out), str(to), checkpoint=1)
    assert str(ei.value) == f"--to: expected a new or empty folder, got {str(to)!r} (another export wrote it meanwhile)"
    assert inner["path"] == to
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    assert json.loads((to / "tokencredit_export.json").read_text())["step"] == 2
    _final_equals_checkpoint(to, _ck(out, 2))  # the winner whole: its weights are its step's
    assert _no_tmp(tmp_path) == []


@pytest.mark.parametrize("writer", ["weights", "tokenizer"])
def test_a_full_disk_during_export_is_one_line_and_leaves_no_temporary_file(tmp_path, tiny_cli, monkeypatch, writer):
    import transformers.modeling_utils as mu
    from transformers import PreTrainedTokenizerBase

    out = _run(tmp_path, steps=1)

    def full_weights(tensors, filename, *a, **k):  # part of the file, then the disk is full
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_tokenizer(self, folder, *a, **k):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "tokenizer.json").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    if writer == "weights":
        monkeypatch.setattr(mu, "safe_save_file", full_weights)
    else:
        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full_tokenizer)
    to = tmp_path / "exp"
    code, err = _cli(["export", str(out), "--to", str(to)])
    assert code == 1 and err.strip().count("\n") == 0, err
    assert err.strip() == (f"tokencredit export: export of step 1: no space left on device writing {str(to)!r} "
                           f"(No space left on device); nothing was written")
    assert not to.exists() and _no_tmp(tmp_path) == []


def test_a_full_disk_during_fidelity_build_is_one_line_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import tokencredit.engine.models as models
    from tokencredit.cli import main

    monkeypatch.setattr(models, "resolve_model", lambda name, **k: tiny_model_and_tokenizer(seed=0))
    real = torch.save

    def full(obj, f, *a, **k):
        if Path(str(getattr(f, "name", f))).parent != tmp_path:
            return real(obj, f, *a, **k)  # the batch's run folder (est.pt.run), not the estimates
        if hasattr(f, "write"):
            f.write(b"\0" * 100)
        else:
            Path(f).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    est = tmp_path / "est.pt"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as ei:
        main(["fidelity", "build", "--model", "tiny", "--task", "add1", "--prompts", "1", "--samples", "2",
              "--max-new-tokens", "3", "-M", "2", "-o", str(est), "--threads", "1"])
    assert ei.value.code == 1
    assert "Traceback" not in err.getvalue()
    msg = err.getvalue().replace("\r", "\n").strip().splitlines()[-1]  # after the build's progress bar
    assert msg == f"tokencredit fidelity: fidelity estimates: no space left on device writing {str(est)!r} (No space left on device)"
    assert not est.exists() and _no_tmp(tmp_path) == []


def test_a_run_killed_before_its_first_checkpoint_offers_overwrite(tmp_path, tiny_cli, monkeypatch):
    import tokencredit.engine.models as models

    def killed(self):
        raise Killed

    monkeypatch.setattr(Trainer, "train_step", killed)
    out = tmp_path / "run"
    with pytest.raises(Killed):
        _cli(["train", "--steps", "3", "--output-dir", str(out)] + TINY_FLAGS)
    assert (out / "config.json").exists() and not (out / "checkpoints").exists()
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    aside = repr(str(tmp_path / "run.old-1"))
    # a fresh train: --overwrite, and no --resume (there is nothing to resume)
    code, err = _cli(["train", "--steps", "3", "--output-dir", str(out)] + TINY_FLAGS)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.strip() == (f"tokencredit train: output_dir: {str(out)!r} holds a run that stopped before its first checkpoint "
                           f"(config.json, metrics.jsonl); start again with --overwrite (the old run is moved to {aside}, nothing is "
                           f"deleted), or choose another --output-dir")
    # --resume: refused before any model loads, offering --overwrite
    code, err = _cli(["train", "--steps", "3", "--output-dir", str(out), "--resume"] + TINY_FLAGS)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.strip() == (f"tokencredit train: resume: the run in {str(out)!r} has no checkpoint to continue from (it "
                           f"stopped before its first one); start again with --overwrite (the old run is moved to {aside}, "
                           f"nothing is deleted), or choose another --output-dir")
