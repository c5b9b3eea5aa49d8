"""``tokencredit export RUN --to DIR [--merge-lora] [--checkpoint STEP]``: a run's weights as a
folder that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load.

The weights come from a checkpoint (the newest intact one, or ``--checkpoint STEP``), put into the
run's base model (``model.name`` in its ``config.json``). A LoRA run gives its adapter (peft's
folder, loadable with ``AutoModelForCausalLM.from_pretrained`` when peft is installed, or
``PeftModel.from_pretrained``) whose ``base_model_name_or_path`` is the base as given: a hub id
stays a hub id, a local folder becomes its absolute path, the embedded model is the absolute path
of its converted copy; ``--merge-lora`` writes the merged full model instead. A run of a
value-head method (gae, pact) also gets ``value_head.pt``.

The run folder (``tokencredit train --output-dir RUN``)::

    RUN/config.json          the run's settings (what export and eval --run rebuild it from)
    RUN/metrics.jsonl        one JSON line per step (step 0: the eval before training)
    RUN/checkpoints/step_XXXXXXXX/state.pt
                             trainable weights (all of them, or the LoRA adapter's), optimizer,
                             scheduler, RNG, data position, method state, critic; the last
                             ``keep_last`` are kept
    RUN/eval/                samples_step_*.jsonl (greedy completions), rollouts_step_*.pt (inspect)
    RUN/final/               the model at the last step, from_pretrained-loadable (full weights, or
                             the adapter of a LoRA run), with its tokenizer

Every model folder (``final/`` and ``export --to``) is written by :func:`write_model_folder`: into
a temporary sibling (``.NAME.tmp-*_PID-START``), with ``tokencredit_export.json`` recording the step and
the sha256 of every file, checked (:func:`check_model_folder`: the files ``from_pretrained``
needs are there and match their sha256) and renamed into place, so a kill leaves the old folder
or the new one, never half of one. ``export --to`` takes a new or empty folder only (an existing
file or a folder with files is refused in one line); two exports to one ``--to`` cannot mix:
each writes its own temporary folder and the first rename wins, the other is refused in one line.
A full disk is one line and leaves no temporary folder; one left by a killed export is removed by
the next export to the same place once its process is gone. The checkpoint is checked before it
is written out (its sha256, finite weights, and exactly the model's trainable weights, each of
the model's shape and dtype: ``checkpoint.copy_weights``); a damaged one is refused in one line.
"""


from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from ..errors import ExportError  # noqa: F401 (defined in errors; importable here too)

__all__ = ["ExportError", "check_model_folder", "export_run", "record_base_model", "write_model_folder"]

#: what every model folder tokencredit writes records: the run, the step, the sha256 of each file
MANIFEST = "tokencredit_export.json"


def _base_as_given(name: str, cache_dir: Optional[str]) -> str:
    """The base model as an adapter should record it: a hub id as it is, a local folder as its
    absolute path (a relative one would break when the adapter is loaded elsewhere)."""
    from ..engine.models import EMBEDDED, EMBEDDED_NAME, cache_root

    if name == EMBEDDED:
        return str((cache_root(cache_dir) / EMBEDDED_NAME).resolve())
    return str(Path(name).resolve()) if os.path.isdir(name) else name


def record_base_model(folder: Path, name: str, cache_dir: Optional[str] = None) -> None:
    """Rewrite ``adapter_config.json``'s ``base_model_name_or_path`` in ``folder`` (a saved peft
    adapter) as the base model as given (:func:`_base_as_given`)."""
    f = Path(folder) / "adapter_config.json"
    if not f.is_file():
        return
    cfg = json.loads(f.read_text())
    cfg["base_model_name_or_path"] = _base_as_given(name, cache_dir)
    f.write_text(json.dumps(cfg, indent=2) + "\n")


# -- model folders: written whole, checked, renamed into place ---------------------------------

#: the files ``from_pretrained`` needs: one of each group
_NEEDED = (
    (("config.json", "adapter_config.json"), "a model config (config.json or adapter_config.json)"),
    (("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "pytorch_model.bin",
      "adapter_model.bin"), "the weights (model.safetensors or adapter_model.safetensors)"),
    (("tokenizer_config.json",), "the tokenizer (tokenizer_config.json)"),
)


def check_model_folder(folder: str | os.PathLike, step: Optional[int] = None) -> Optional[str]:
    """Why ``folder`` is not a whole model folder written by :func:`write_model_folder` (of
    ``step``, when given), or None when it is: its ``tokencredit_export.json`` lists each file
    with its sha256, each is there with those bytes, and the files ``from_pretrained`` needs are
    among them."""
    from .checkpoint import file_sha256

    folder = Path(folder)
    if not folder.is_dir():
        return "missing" if not folder.exists() else "not a folder"
    try:
        info = json.loads((folder / MANIFEST).read_text())
        files = info["files"]
        assert isinstance(files, dict) and files
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"incomplete ({MANIFEST} with the sha256 of its files missing or unreadable)"
    if step is not None and info.get("step") != step:
        return f"holds step {info.get('step')}, not step {step}"
    for names, what in _NEEDED:
        if not any(n in files for n in names):
            return f"incomplete (no {what})"
    for name, digest in sorted(files.items()):
        f = folder / name
        if not f.is_file():
            return f"incomplete ({name} missing)"
        if file_sha256(f) != digest:
            return f"damaged ({name} differs from its sha256 in {MANIFEST})"
    return None


def _remove_dead_temporaries(out: Path) -> None:
    """The temporary folders of writes to ``out`` whose process is gone (a killed export);
    never a live one's, nor this process's own (an export running beside this one)."""
    from .processes import process_tag, stale_temporaries

    own = f"_{process_tag()}"
    for p in stale_temporaries(out.parent, f".{out.name}.tmp-"):
        if not p.name.endswith(own):
            shutil.rmtree(p, ignore_errors=True)


def _temporary(out: Path, kind: str = "") -> Path:
    """A new empty folder next to ``out``, named for its writer (``.NAME.tmp-*_<pid>-<start>``)."""
    from .processes import process_tag

    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{kind}", suffix=f"_{process_tag()}", dir=out.parent))


def _disk_full(e: BaseException) -> bool:
    """A write that failed for want of space: an OSError (ENOSPC / EDQUOT), or safetensors' own
    error, which carries the OS error only in its message ("No space left on device (os error 28)")."""
    from ..errors import is_disk_full

    return is_disk_full(e) or "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' "Writing model shards" bar off while a folder is written (the command
    prints one line when it is done)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _publish(tmp: Path, out: Path, replace: bool) -> None:
    """Rename the checked folder ``tmp`` to ``out``. ``replace``: an ``out`` already there is moved
    aside first and removed after. Otherwise ``out`` must be missing or empty at the rename
    itself (the kernel refuses a folder with files): an export that got there first wins."""
    if replace and out.exists():
        aside = _temporary(out, "old-")
        os.replace(out, aside)  # (mkdtemp made it empty: the rename replaces it)
        os.rename(tmp, out)
        shutil.rmtree(aside, ignore_errors=True)
        return
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise ExportError(f"--to: expected a new or empty folder, got {str(out)!r} (another export wrote it meanwhile)") from None
        raise


def write_model_folder(out: str | os.PathLike, model, tokenizer, *, what: str, replace: bool, base_model: str,
                       cache_dir: Optional[str], lora: bool, critic: Optional[Dict[str, Any]], info: Dict[str, Any],
                       on_disk_full: str = "nothing was written") -> Path:
    """``model`` (or its adapter) and ``tokenizer`` as a from_pretrained folder ``out``, written
    whole or not at all: into a temporary sibling, with ``value_head.pt`` (``critic``) and
    ``tokencredit_export.json`` (``info`` and the sha256 of every file), fsynced, checked with
    :func:`check_model_folder`, then renamed into place (``replace``: over a folder already there;
    else ``out`` must be new or empty). A failure (a full disk: one line naming ``what`` and
    ``out``, then ``on_disk_full``; a Ctrl-C) removes the temporary folder."""
    from .checkpoint import file_sha256, save_torch
    from ..errors import DiskFullError

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(out)
    tmp = _temporary(out)
    try:
        with _quiet_progress():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        if lora:  # the adapter records its base model as given (a hub id, or an absolute path)
            record_base_model(tmp, base_model, cache_dir)
        if critic is not None:
            save_torch(critic, tmp / "value_head.pt")
        files = {}
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                files[str(f.relative_to(tmp))] = file_sha256(f)
        manifest = {"base_model": _base_as_given(base_model, cache_dir), "lora": bool(lora), **info, "files": files}
        with open(tmp / MANIFEST, "w") as fh:
            fh.write(json.dumps(manifest, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        problem = check_model_folder(tmp, step=info.get("step"))
        if problem is not None:
            raise ExportError(f"{what}: the folder written for {str(out)!r} is {problem}; nothing was written")
        _publish(tmp, out, replace)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(e):
            cause = e if isinstance(e, OSError) and e.errno else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            err = DiskFullError(out, what, cause)
            err.message += f"; {on_disk_full}"
            raise err from None
        raise
    return out


# -- tokencredit export RUN --to DIR ------------------------------------------------------------


def _check_to(out: Path, run: Path, to: str) -> None:
    from .checkpoint import check_output_dir

    if out.is_file():
        raise ExportError(f"--to: expected a new or empty folder, got {to!r}, which is a file")
    if out.resolve() == run.resolve() or out.is_dir() and any(out.iterdir()):
        raise ExportError(f"--to: expected a new or empty folder, got {to!r}")
    check_output_dir(out, "--to")


def export_run(run: str, to: str, *, merge_lora: bool = False, checkpoint: Optional[int] = None) -> Path:
    """Write RUN's model (a checkpoint's weights in its base model) to ``to``; returns the folder."""
    from .checkpoint import CheckpointError
    from .runfolder import RunFolder

    folder = RunFolder(run, arg="RUN", error=ExportError)
    run_p = folder.path
    cfg = folder.config()
    out = Path(to)
    _check_to(out, run_p, to)
    if merge_lora and not cfg.model.lora:
        raise ExportError(f"--merge-lora: the run {run!r} trained the full model (model.lora false); there is no adapter to merge")
    try:  # (None: the newest) loaded and checked, its sha256 and finite weights, before any model loads
        ck, state = folder.load_checkpoint(checkpoint)
    except CheckpointError as e:  # a damaged one: name an earlier step to export
        if e.unsafe:
            raise
        step = checkpoint if checkpoint is not None else folder.steps()[-1]
        earlier = [s for s in folder.steps() if s < step]
        hint = f"; export an earlier one with --checkpoint {earlier[-1]}" if earlier else ""
        raise CheckpointError(f"{e}{hint}") from None
    # every trainable weight of the model, of its shape and dtype (else one line naming it)
    loaded = folder.load_model(ck, state=state)
    model, tok = loaded.model, loaded.tokenizer
    if cfg.model.lora and merge_lora:
        model = model.merge_and_unload()
    step = int(state["step"])
    return write_model_folder(
        out, model, tok, what=f"export of step {step}", replace=False, base_model=cfg.model.name,
        cache_dir=cfg.model.cache_dir, lora=bool(cfg.model.lora and not merge_lora), critic=state.get("critic"),
        info={"run": str(run_p.resolve()), "checkpoint": str(ck.resolve()), "step": step, "lora": bool(cfg.model.lora),
              "merged": bool(merge_lora)},
    )
