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
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

__all__ = ["ExportError", "export_run", "record_base_model"]


class ExportError(ValueError):
    """A run folder or checkpoint that cannot be exported; the message names it."""


def _base_as_given(name: str, cache_dir: Optional[str]) -> str:
    """The base model as an adapter should record it: a hub id as it is, a local folder as its
    absolute path (a relative one would break when the adapter is loaded elsewhere)."""
    from .models import _EMBEDDED_NAME, EMBEDDED, cache_root

    if name == EMBEDDED:
        return str((cache_root(cache_dir) / _EMBEDDED_NAME).resolve())
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


def _checkpoint(run: Path, step: Optional[int]):
    from .checkpoint import load_checkpoint, load_latest_checkpoint

    root = run / "checkpoints"
    if step is None:
        return load_latest_checkpoint(root)
    ck = root / f"step_{step:08d}"
    if not ck.is_dir():
        have = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()) if root.is_dir() else []
        raise ExportError(f"--checkpoint: expected one of the run's checkpoint steps {have}, got {step}")
    return ck, load_checkpoint(ck)


def export_run(run: str, to: str, *, merge_lora: bool = False, checkpoint: Optional[int] = None) -> Path:
    """Write RUN's model (a checkpoint's weights in its base model) to ``to``; returns the folder."""
    import torch

    from .config import TrainConfig, _from_dict
    from .models import add_lora, resolve_model

    run_p = Path(run)
    cfg_file = run_p / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"RUN: expected a tokencredit run folder (with config.json), got {run!r}")
    out = Path(to)
    if out.resolve() == run_p.resolve() or out.exists() and any(out.iterdir()):
        raise ExportError(f"--to: expected a new or empty folder, got {to!r}")
    try:
        cfg = _from_dict(TrainConfig, json.loads(cfg_file.read_text()), "config.json")
    except json.JSONDecodeError as e:
        raise ExportError(f"RUN: {cfg_file} is not valid JSON ({e})") from None
    if merge_lora and not cfg.model.lora:
        raise ExportError(f"--merge-lora: the run {run!r} trained the full model (model.lora false); there is no adapter to merge")
    ck, state = _checkpoint(run_p, checkpoint)
    model, tok = resolve_model(cfg.model.name, cache_dir=cfg.model.cache_dir)
    if cfg.model.lora:
        model = add_lora(model, r=cfg.model.lora_r, alpha=cfg.model.lora_alpha, target_modules=cfg.model.lora_targets)
    params = dict(model.named_parameters())
    weights = state["model"]
    unknown = sorted(n for n in weights if n not in params)
    if unknown:
        raise ExportError(f"checkpoint {ck}: weights {unknown[:3]} are not parameters of {cfg.model.name!r} (another base model?)")
    with torch.no_grad():
        for n, v in weights.items():
            params[n].copy_(v)
    if cfg.model.lora and merge_lora:
        model = model.merge_and_unload()
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if cfg.model.lora and not merge_lora:
        record_base_model(tmp, cfg.model.name, cfg.model.cache_dir)
    if state.get("critic") is not None:
        torch.save(state["critic"], tmp / "value_head.pt")
    (tmp / "tokencredit_export.json").write_text(json.dumps(
        {"run": str(run_p.resolve()), "checkpoint": str(ck.resolve()), "step": int(state["step"]),
         "base_model": _base_as_given(cfg.model.name, cfg.model.cache_dir), "lora": bool(cfg.model.lora),
         "merged": bool(merge_lora)}, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out
