"""Data through ``datasets``: own data (``--data.path``), and the gsm8k / math tasks' files.

``data.path`` is a local file (``.json``, ``.jsonl``, ``.csv``, ``.parquet``), a folder of such
files (``train.*``, ``test.*`` / ``validation.*`` become splits, ``datasets``' own rules), or a
hub id ``owner/name[:config]``. The row's prompt is the column ``data.prompt_column``: a string
(TRL's standard prompt-only layout) or a list of chat messages (TRL's conversational layout,
verl's parquet ``prompt``). The reference answer, if any, is ``data.answer_column`` (a dotted name
reaches into a mapping: verl's ``reward_model.ground_truth``); unset, the first of ``answer``,
``solution``, ``ground_truth``, ``reward_model.ground_truth`` the rows have. Every other column goes to the reward
functions as a keyword argument (TRL's contract). Nothing is appended to own prompts unless
``data.prompt_template`` says so (``"{prompt}\\nPut your final answer within \\\\boxed{}."``);
``data.system_prompt`` adds a system message.

Evaluation rows: ``data.eval_path`` (another file, folder or hub id; its ``data.eval_split``),
else ``data.eval_split`` of ``data.path``, else a ``test`` / ``validation`` split of it, else
``data.eval_fraction`` of the rows (held out by a fixed shuffle; default 0.1, at least one row,
said in the log). Every problem is one line naming the field before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

from ..errors import DatasetError  # noqa: F401 (defined in errors; importable here too)

__all__ = [
    "DATA_EVAL_FRACTION",
    "DATA_FIELDS",
    "DatasetError",
    "Example",
    "OwnData",
    "column_value",
    "data_files",
    "data_fingerprint",
    "setting",
    "load_own_data",
    "load_splits",
]

#: the share of rows held out for evaluation when the data has no eval split and none is named
DATA_EVAL_FRACTION = 0.1
#: the seed of the fixed shuffle that holds eval rows out of a single split
EVAL_SEED = 1234

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(?::[\w.-]+)?$")
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_ANSWER_GUESSES = ("answer", "solution", "ground_truth", "reward_model.ground_truth")


@dataclass(frozen=True)
class Example:
    """One prompt. ``messages`` are plain chat dicts (what ``apply_chat_template`` takes) as the
    model sees them; ``question`` is the user message text (OPPO's oracle prompt restates it),
    ``answer`` the reference answer as text ("" when there is none). ``prompt`` is what reward
    functions get as ``prompts`` (None: ``question``), ``row`` the other columns, passed to them
    as keyword arguments (None: ``{"answer": answer}``)."""

    id: str
    question: str
    answer: str
    messages: tuple
    prompt: Any = None
    row: Optional[Mapping[str, Any]] = None

    # messages hold dicts (unhashable): hash the identifying strings instead
    def __hash__(self) -> int:
        return hash((self.id, self.question, self.answer))

    def columns(self) -> Dict[str, Any]:
        """The keyword arguments of a reward call for this row (a new dict)."""
        return dict(self.row) if self.row is not None else {"answer": self.answer}

    def prompt_value(self) -> Any:
        return self.prompt if self.prompt is not None else self.question

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, (list, tuple))


def column_value(row: Mapping[str, Any], name: str) -> Any:
    """``row[name]``; a dotted name reaches into mappings (``reward_model.ground_truth``).
    KeyError when it is not there."""
    if name in row:
        return row[name]
    cur: Any = row
    for part in name.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise KeyError(name)
        cur = cur[part]
    return cur


def _has_column(rows: Sequence[Mapping[str, Any]], name: str) -> bool:
    if not rows:
        return False
    try:
        column_value(rows[0], name)
        return True
    except KeyError:
        return False


# ---------------------------------------------------------------------------------------------
# Loading through datasets
# ---------------------------------------------------------------------------------------------


def _jsonl_problem(path: Path) -> Optional[str]:
    """The first line of a JSONL file that is not a JSON object, as "FILE:LINE is not JSON (...)"."""
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{path}:{n} is not JSON ({e.msg}, column {e.colno})"
                if not isinstance(obj, dict):
                    return f"{path}:{n} is a {type(obj).__name__}, not an object with named columns"
    except UnicodeDecodeError as e:
        return f"{path} is not UTF-8 text (undecodable bytes at offset {e.start})"
    return None


def _quiet_datasets():
    import datasets

    class _Quiet:
        def __enter__(self):
            self.was = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()

        def __exit__(self, *exc):
            if self.was:
                datasets.enable_progress_bars()

    return _Quiet()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def data_files(folder: Path) -> List[Path]:
    """The data files ``datasets`` reads in ``folder`` (its own rules: any depth, hidden and
    ``__`` entries left out), those of the formats tokencredit reads, sorted."""
    out = []
    for f in folder.rglob("*"):
        rel = f.relative_to(folder).parts
        if f.suffix.lower() in _BUILDERS and f.is_file() and not any(x.startswith((".", "__")) for x in rel):
            out.append(f)
    return sorted(out)


def _one_format(folder: Path, path: str, field: str) -> None:
    """Refuse a folder of data files in two or more formats: ``datasets`` would read the files of
    one format only and leave the others out without a word."""
    files = data_files(folder)
    if len({_BUILDERS[f.suffix.lower()] for f in files}) > 1:
        named = [f"{f.relative_to(folder).as_posix()} ({_BUILDERS[f.suffix.lower()]})" for f in files[:8]]
        more = f" and {len(files) - 8} more" if len(files) > 8 else ""
        raise DatasetError(f"{field}: expected the files of one format in the folder {path!r}, got {', '.join(named)}{more}; "
                           f"keep one format there, or name one file")


def _distinct_csv_columns(files: Sequence[Path], path: str, field: str) -> None:
    """Refuse a CSV file that names a column twice: pandas (under ``datasets``) would rename the
    second ``prompt`` to ``prompt.1`` without a word."""
    import csv

    for f in files:
        if f.suffix.lower() != ".csv":
            continue
        try:
            with f.open(newline="", encoding="utf-8") as fh:
                header = next(csv.reader(fh), [])
        except (OSError, UnicodeDecodeError, csv.Error):
            continue  # the loader says what is wrong with it
        first: Dict[str, int] = {}
        for i, name in enumerate(header, 1):
            if name in first:
                where = path if Path(path).is_file() else str(f)
                raise DatasetError(f"{field}: expected distinct column names in {where!r}, got {name!r} twice "
                                   f"(columns {first[name]} and {i}); rename one")
            first[name] = i


def load_splits(path: str, field: str = "data.path") -> Tuple[Dict[str, List[Dict[str, Any]]], str]:
    """``path`` (a file, a folder or a hub id ``owner/name[:config]``) -> ({split: rows}, a short
    name for messages). A single file is one split, ``train``."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is in the train extra
        raise ImportError("data files are read with the `datasets` package: pip install 'tokencredit[train]'") from e
    if not isinstance(path, str) or not path.strip():
        raise DatasetError(f"{field}: expected a file, a folder or a hub id 'owner/name[:config]', got {path!r}")
    p = Path(path)
    with _quiet_datasets():
        if p.is_file():
            builder = _BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DatasetError(f"{field}: expected a .json, .jsonl, .csv or .parquet file, got {path!r}")
            if p.suffix.lower() == ".jsonl":
                problem = _jsonl_problem(p)
                if problem:
                    raise DatasetError(f"{field}: expected one JSON object per line, {problem}")
            _distinct_csv_columns([p], path, field)
            try:
                ds = datasets.load_dataset(builder, data_files=str(p), split="train")
            except Exception as e:  # datasets / pyarrow errors share no useful base class
                cause = e.__cause__ or e.__context__ or e
                raise DatasetError(f"{field}: cannot read {path!r} as {builder} ({type(cause).__name__}: {_one_line(cause)})") from None
            return {"train": ds.to_list()}, str(p)
        if p.is_dir():
            _one_format(p, path, field)
            _distinct_csv_columns(data_files(p), path, field)
            try:
                dd = datasets.load_dataset(str(p))
            except Exception as e:
                cause = e.__cause__ or e.__context__ or e
                raise DatasetError(
                    f"{field}: cannot read the folder {path!r} as a dataset (.json/.jsonl/.csv/.parquet files; "
                    f"{type(cause).__name__}: {_one_line(cause)})"
                ) from None
            return {k: v.to_list() for k, v in dd.items()}, str(p)
        if _HUB_ID.match(path) and not path.startswith((".", "/")):
            hub, _, config = path.partition(":")
            try:
                dd = datasets.load_dataset(hub, config or None)
            except Exception as e:
                raise DatasetError(f"{field}: cannot load the hub dataset {path!r} ({type(e).__name__}: {_one_line(e)})") from None
            return {k: v.to_list() for k, v in dd.items()}, path
    raise DatasetError(f"{field}: expected an existing file or folder, or a hub id 'owner/name[:config]', got {path!r}")


def _split(splits: Dict[str, list], name: str, where: str, field: str) -> List[Dict[str, Any]]:
    if name not in splits:
        raise DatasetError(f"{field}: expected one of the splits {sorted(splits)} of {where}, got {name!r}")
    return splits[name]


# ---------------------------------------------------------------------------------------------
# Rows -> examples
# ---------------------------------------------------------------------------------------------


def _digest(value: Any) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:12]


def _answer_text(value: Any) -> str:
    from .grading import gold_answer

    gold = gold_answer(value)
    return gold if gold is not None else ""


def _check_messages(value: Any, where: str, i: int, field: str) -> List[Dict[str, Any]]:
    msgs = list(value)
    for m in msgs:
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m):
            raise DatasetError(
                f"{field}: expected a string or a list of chat messages ({{'role': ..., 'content': ...}}) in row {i} "
                f"of {where}, got {json.dumps(value, default=str)[:80]}"
            )
    if not any(m["role"] == "user" for m in msgs):
        raise DatasetError(f"{field}: expected a user message in row {i} of {where}, got roles {[m['role'] for m in msgs]}")
    return [dict(m) for m in msgs]


def rows_to_examples(rows: Sequence[Mapping[str, Any]], *, where: str, prompt_column: str, answer_column: Optional[str],
                     system_prompt: Optional[str] = None, template: Optional[str] = None, prefix: str = "data") -> List[Example]:
    """Own rows -> :class:`Example` s: the prompt (a string or chat messages) with the template
    applied to its (last user) text and the system prompt first; every column but the prompt
    is the row the reward functions receive."""
    out = []
    for i, row in enumerate(rows):
        try:
            value = column_value(row, prompt_column)
        except KeyError:
            raise DatasetError(f"data.prompt_column: expected a column {prompt_column!r} in row {i} of {where}, got columns {sorted(row)}") from None
        if isinstance(value, str):
            if not value.strip():
                raise DatasetError(f"data.prompt_column: expected a non-empty prompt in row {i} of {where}, got {value!r}")
            text = template.replace("{prompt}", value) if template else value
            msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
            prompt: Any = text
            question = text
        elif isinstance(value, (list, tuple)):
            msgs = _check_messages(value, where, i, "data.prompt_column")
            last = max(j for j, m in enumerate(msgs) if m["role"] == "user")
            if template:
                msgs[last] = dict(msgs[last], content=template.replace("{prompt}", str(msgs[last]["content"])))
            if system_prompt:
                if msgs[0]["role"] == "system":
                    raise DatasetError(
                        f"data.system_prompt: row {i} of {where} has its own system message; expected no "
                        f"data.system_prompt with such data, got {system_prompt[:40]!r}"
                    )
                msgs = [{"role": "system", "content": system_prompt}] + msgs
            prompt = msgs
            question = str(msgs[last]["content"])
        else:
            raise DatasetError(
                f"data.prompt_column: expected a string or a list of chat messages in column {prompt_column!r} of {where}, "
                f"got {type(value).__name__} in row {i}"
            )
        answer = ""
        if answer_column is not None:
            try:
                answer = _answer_text(column_value(row, answer_column))
            except KeyError:
                raise DatasetError(
                    f"data.answer_column: expected a column {answer_column!r} in row {i} of {where}, got columns {sorted(row)}"
                ) from None
        rest = {k: v for k, v in row.items() if k != prompt_column}
        out.append(Example(id=f"{prefix}-{_digest(value)}", question=question, answer=answer,
                           messages=tuple(msgs), prompt=prompt, row=rest))
    return out


@dataclass
class OwnData:
    """The examples of ``data.*`` and where they came from."""

    train: List[Example]
    eval: List[Example]
    answer_column: Optional[str]
    columns: List[str]
    where: str
    #: the eval rows there were before ``n_eval`` (of ``eval_where``), and whether they are a
    #: hold-out of ``data.path``'s rows (``data.eval_fraction``)
    eval_of: int = 0
    eval_where: str = ""
    held_out: bool = False


def _check_columns(rows: Sequence[Mapping[str, Any]], where: str, prompt_column: str, answer_column: Optional[str]) -> Optional[str]:
    if not rows:
        raise DatasetError(f"data.path: expected rows in {where}, got none")
    cols = sorted(rows[0])
    if not _has_column(rows, prompt_column):
        raise DatasetError(f"data.prompt_column: expected a column {prompt_column!r} in {where}, got columns {cols}")
    if answer_column is not None:
        if not _has_column(rows, answer_column):
            raise DatasetError(f"data.answer_column: expected a column {answer_column!r} in {where}, got columns {cols}")
        return answer_column
    return next((c for c in _ANSWER_GUESSES if c != prompt_column and _has_column(rows, c)), None)


def load_own_data(data: Any, *, seed: int, n_train: int, n_eval: int, hold_out: bool = True) -> OwnData:
    """``data`` (a ``DataConfig``: path, split, eval_path, eval_split, eval_fraction,
    prompt_column, answer_column, system_prompt, prompt_template) -> the train and eval examples
    (at most ``n_train`` / ``n_eval``; train shuffled by ``seed``, eval by a fixed seed).
    ``hold_out=False`` (``tokencredit eval``): data without an eval split and no
    ``data.eval_fraction`` is evaluated whole, every row of ``data.split``."""
    splits, where = load_splits(data.path, "data.path")
    train_rows = _split(splits, data.split, where, "data.split")
    answer_column = _check_columns(train_rows, where, data.prompt_column, data.answer_column)
    kw = dict(prompt_column=data.prompt_column, answer_column=answer_column, system_prompt=data.system_prompt,
              template=data.prompt_template)
    eval_rows = None
    eval_where = where
    if data.eval_path is not None:
        esplits, eval_where = load_splits(data.eval_path, "data.eval_path")
        eval_rows = _split(esplits, data.eval_split or ("train" if "train" in esplits and len(esplits) == 1 else
                                                       next((s for s in ("test", "validation", "train") if s in esplits), "train")),
                           eval_where, "data.eval_split")
        _check_columns(eval_rows, eval_where, data.prompt_column, answer_column)
    elif data.eval_split is not None:
        if data.eval_split == data.split:
            raise DatasetError(f"data.eval_split: expected a split other than data.split {data.split!r}, got {data.eval_split!r}")
        eval_rows = _split(splits, data.eval_split, where, "data.eval_split")
    elif data.eval_fraction is None:
        found = next((s for s in ("test", "validation") if s in splits and s != data.split), None)
        if found is not None:
            eval_rows = splits[found]
            logger.info("data: evaluating on the %r split of %s", found, where)
    train = rows_to_examples(train_rows, where=where, **kw)
    if eval_rows is None and not hold_out and data.eval_fraction is None:
        eval_rows = train_rows  # the whole file is the eval set
    held_out = eval_rows is None
    if eval_rows is not None:
        ev = rows_to_examples(eval_rows, where=eval_where, **kw)
        eval_of = len(ev)
        random.Random(f"data-eval-{EVAL_SEED}").shuffle(ev)
        ev = ev[:n_eval]
    else:
        eval_of = len(train)
        frac = data.eval_fraction if data.eval_fraction is not None else DATA_EVAL_FRACTION
        order = list(range(len(train)))
        random.Random(f"data-eval-{EVAL_SEED}").shuffle(order)
        k = min(n_eval, max(1, int(math.floor(frac * len(train)))))
        if k >= len(train):
            raise DatasetError(
                f"data.eval_fraction: holding out {k} of {len(train)} rows of {where} leaves none to train on; "
                f"expected more rows, a smaller data.eval_fraction or data.eval_path"
            )
        held = set(order[:k])
        ev = [train[i] for i in order[:k]]
        train = [e for i, e in enumerate(train) if i not in held]
        (logger.info if data.eval_fraction is not None else logger.warning)(
            "data: held out %d of %d rows of %s for evaluation (data.eval_fraction %s%s)", k, k + len(train), where, frac,
            "" if data.eval_fraction is not None else ", the default; set data.eval_path, data.eval_split or data.eval_fraction")
    random.Random(f"data-train-{seed}").shuffle(train)
    return OwnData(train=train[:n_train], eval=ev, answer_column=answer_column, columns=sorted(train_rows[0]), where=where,
                   eval_of=eval_of, eval_where=eval_where, held_out=held_out)


def load_task_rows(name: str, path: Optional[str], hub_default: Tuple[str, Optional[str]]) -> Tuple[List[dict], Optional[List[dict]], str]:
    """The gsm8k / math tasks' rows: ``path`` (file, folder, hub id) or the task's hub default ->
    (train rows, test/validation rows or None, where)."""
    source = path if path is not None else (hub_default[0] + (f":{hub_default[1]}" if hub_default[1] else ""))
    splits, where = load_splits(source, "task.path")
    if "train" not in splits:
        raise DatasetError(f"task.path: expected a 'train' split in {where}, got splits {sorted(splits)}")
    test = next((splits[s] for s in ("test", "eval", "validation") if s in splits), None)
    return splits["train"], test, where


# ---------------------------------------------------------------------------------------------
# The data a run trained on: its files' sha256 (runfolder records it and checks it on resume)
# ---------------------------------------------------------------------------------------------

#: the settings that name data files: a run records the sha256 of each local file they name
DATA_FIELDS = ("data.path", "data.eval_path", "task.path")
_HASHES: Dict[Tuple, str] = {}


def _sha256(f: Path) -> str:
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _HASHES:  # a resume checks twice (config.json, then the checkpoint's copy)
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def setting(config: Mapping[str, Any], name: str) -> Any:
    section, key = name.split(".")
    part = config.get(section)
    return part.get(key) if isinstance(part, Mapping) else None


def data_fingerprint(config: Mapping[str, Any]) -> Dict[str, Dict[str, str]]:
    """``{setting: {file: sha256}}`` for each setting of :data:`DATA_FIELDS` in ``config``
    (``config_to_dict``) that names a local file or folder (a folder: each of its data files, by
    relative name). A hub id, or a path that is not there, has no entry."""
    out = {}
    for name in DATA_FIELDS:
        value = setting(config, name)
        if not isinstance(value, str) or not value.strip():
            continue
        p = Path(value)
        if p.is_file():
            out[name] = {p.name: _sha256(p)}
        elif p.is_dir():
            out[name] = {f.relative_to(p).as_posix(): _sha256(f) for f in data_files(p)}
    return out
