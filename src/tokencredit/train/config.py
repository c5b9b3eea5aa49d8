"""Training configuration: typed dataclasses, a YAML file, command-line overrides (tyro).

    tokencredit train --credit taco                          # embedded default, short run
    tokencredit train --credit grpo+taco --credit-config.taco.lam 0.5   # a method's setting
    tokencredit train --config run.yaml --rollout.temperature 0.7 --steps 50

Defaults are sized for the embedded SmolLM2-135M-Instruct on 2 CPU cores: a short run that
finishes in about six minutes (357 s measured) and shows a learning signal on 1-digit multiplication.

Three modules, one job each: ``config_fields`` checks a value against its field (types, ranges,
bounded YAML), ``config_sections`` declares the sections (model, task, ..., log), and this
module assembles ``TrainConfig`` from them and the credit methods' own configs: its checks,
recipes, loading from YAML and the command line (tyro), and what a resume may change. Every
name stays importable from here (``from tokencredit.train.config import ModelConfig, ConfigError``).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple

import yaml

from .config_fields import (
    FIELD_RANGES,
    YAML_MAX_DEPTH,
    YAML_MAX_VALUES,
    ConfigError,
    brief_repr,
    check_section,
    load_yaml_bounded,
)
from .config_sections import (
    CriticConfig,
    DapoConfig,
    DataConfig,
    LogConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TaskConfig,
)
from ..errors import one_line

__all__ = [
    "ModelConfig",
    "TaskConfig",
    "DataConfig",
    "RewardConfig",
    "RolloutConfig",
    "OptimConfig",
    "LossConfig",
    "CriticConfig",
    "DapoConfig",
    "LogConfig",
    "MethodConfigs",
    "TrainConfig",
    "load_config",
    "RECIPES",
    "ConfigError",
    "SAFE_TO_CHANGE",
    "config_diff",
    "config_from_dict",
    "config_to_dict",
    "configured_methods",
    "credit_config_for",
]


#: set while the command line is parsed: TrainConfig checks itself once, after tyro is done
_DEFER_CHECKS: contextvars.ContextVar = contextvars.ContextVar("tokencredit_defer_checks", default=False)


def _make_method_configs() -> type:
    """The ``credit_config`` section: one field per registered credit method, typed by the
    method's own config dataclass, so that ``--help`` lists every method setting with its default
    and the source comment of the method's file, and YAML is checked against the same class.
    Methods registered after this module is imported (plugins) are set with ``credit_args``."""
    import tyro

    from ..credit.registry import get_method, list_methods

    fields = []
    for name in list_methods():
        info = get_method(name)
        if not name.isidentifier():  # not a field name: reachable through credit_args only
            continue
        about = f"{info.summary} ({info.kind}; provenance: {info.provenance})"
        fields.append((name, Annotated[info.config_cls, tyro.conf.arg(help=about)], field(default_factory=info.config_cls)))
    cls = dataclasses.make_dataclass("MethodConfigs", fields)
    cls.__module__ = __name__  # pickling, and tyro reads the type hints in this module
    cls.__doc__ = "Each credit method's settings (its own config dataclass); only the spec's methods may be set."
    return cls


#: ``TrainConfig.credit_config``'s type: a field per built-in method (``credit_config.taco`` is a
#: ``TACOConfig``)
MethodConfigs = _make_method_configs()


def _method_message(e: BaseException, method: str, where: str) -> str:
    """A method config's own error (``"taco lam: expected ..."``) as ``"<where>.lam: expected ..."``."""
    msg = one_line(e)
    m = re.match(rf"{re.escape(method)} (\w+): (.*)", msg)
    return f"{where}.{m.group(1)}: {m.group(2)}" if m else f"{where}: {msg}"


def _check_method_config(obj: Any, method: str, where: str) -> Any:
    """Check one method config: the types of its fields (from its annotations; floats may be
    infinite, several methods' "off" is inf), then the method's own checks (its
    ``__post_init__``, run again on a copy, which is returned). A :class:`ConfigError` naming the
    field (``"credit_config.taco.lam: expected a number in [0, 1], got 2"``)."""
    check_section(obj, f"{where}.", finite=False)
    try:
        return dataclasses.replace(obj)
    except (ValueError, TypeError) as e:
        raise ConfigError(_method_message(e, method, where)) from None


def _plain(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _spec_of(credit: str) -> str:
    return RECIPES[credit]["credit"] if credit in RECIPES else credit


def configured_methods(section: Any) -> List[str]:
    """The methods of a ``credit_config`` section (:class:`MethodConfigs`) whose settings differ
    from their defaults: the methods a user configured."""
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != f.default_factory()]


@dataclass
class TrainConfig:
    credit: str = "grpo"  # a credit spec ("grpo+taco", "oppo+stare") or a recipe ("dapo")
    # shorthand for the --credit-config.METHOD.FIELD options below: "method.field=value", values
    # parsed as YAML, e.g. taco.lam=0.5 stare.P=0.2; one field set to two values is an error
    credit_args: Tuple[str, ...] = ()
    steps: int = 30  # training steps (a rollout batch and an update each); a resume may raise it
    seed: int = 0  # seed of torch and numpy: sampling, data order, initialisation
    output_dir: str = "runs/default"  # the run directory: config.json, metrics.jsonl, checkpoints, eval
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N | mps
    threads: Optional[int] = None  # torch intra-op threads on CPU
    # CPU runs: glibc keeps freed memory for the next step instead of unmapping it (mallopt
    # M_MMAP_MAX=0, trim threshold 2 GiB), so a step does not zero-fill ~0.5 GB of fresh pages;
    # about 9% a step on the embedded model, process-wide (tokencredit.engine.cpu_memory)
    retain_memory: bool = True
    # numbers of rollouts, signal passes and the update: fp32, or bf16 (generation on a bf16 copy
    # of the weights, forward/backward under bf16 autocast; weights, gradients and AdamW state
    # stay fp32), or auto (bf16 where the CPU has bf16 matrix units, amx_bf16/avx512_bf16, or the
    # GPU supports bf16; else fp32). config.json records the resolved one; resume keeps it
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    save_every: int = 10  # a checkpoint every N steps (and at the last)
    keep_last: int = 2  # checkpoints kept; older ones are deleted
    resume: bool = False  # continue output_dir's run from its latest checkpoint (same settings)
    # start again in an output_dir that holds a run: the old run's files are moved to <output_dir>.old-<k>
    overwrite: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy, and the frozen models a method may need
    task: TaskConfig = field(default_factory=TaskConfig)  # a built-in task and its reward
    data: DataConfig = field(default_factory=DataConfig)  # own data: --data.path replaces task.name's task
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    dapo: DapoConfig = field(default_factory=DapoConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # each method's settings (``credit_config.taco.lam``), typed by the method's config class;
    # only the credit spec's methods may be set. YAML: ``credit_config: {taco: {lam: 0.5}}``
    credit_config: MethodConfigs = field(default_factory=MethodConfigs)

    def __post_init__(self):
        if isinstance(self.credit_config, dict):  # TrainConfig(credit_config={"taco": {"lam": 0.5}})
            self.credit_config = _from_dict(MethodConfigs, self.credit_config, "credit_config")
        if not _DEFER_CHECKS.get():
            self.check_fields()

    def check_fields(self) -> None:
        """Types and ranges of every field, and the names they refer to (task, loss, credit spec):
        a :class:`ConfigError` naming the first bad field. Runs on construction; the sections are
        checked again by :meth:`validate` (they may have been changed since)."""
        check_section(self)
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                check_section(sub, f"{f.name}.")
        if not self.model.lora_targets:
            raise ConfigError("model.lora_targets: expected at least one module name, got ()")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ConfigError(f"device: expected auto, cpu, cuda, cuda:N or mps, got {brief_repr(self.device)}")
        rf = self.task.reward_fn
        if rf is not None and not re.fullmatch(r"[^:]+:[\w.]+", rf):
            raise ConfigError(f"task.reward_fn: expected 'package.module:function' or 'file.py:function', got {brief_repr(rf)}")
        _check_data_and_reward(self)
        if self.dapo.overlong_cache is not None and self.dapo.overlong_cache > self.rollout.max_new_tokens:
            raise ConfigError(
                f"dapo.overlong_cache: expected <= rollout.max_new_tokens ({self.rollout.max_new_tokens}), "
                f"got {self.dapo.overlong_cache}"
            )
        for f in dataclasses.fields(self.credit_config):
            _check_method_config(getattr(self.credit_config, f.name), f.name, f"credit_config.{f.name}")
        parse_credit_args(self.credit_args)
        from ..credit.spec import parse_spec

        try:
            parse_spec(RECIPES[self.credit]["credit"] if self.credit in RECIPES else self.credit)
        except (KeyError, ValueError) as e:
            raise ConfigError(
                f"credit: expected a credit spec (e.g. 'grpo+taco') or a recipe ({', '.join(sorted(RECIPES))}), "
                f"got {brief_repr(self.credit)}: {one_line(e)}"
            ) from None

    def validate(self) -> "TrainConfig":
        """Everything :meth:`check_fields` checks, plus the method settings (``credit_config``
        and ``credit_args``) against the spec. Called before any model is loaded (``Trainer``,
        the command line)."""
        self.check_fields()
        self.method_configs()
        _check_device(self.device)
        return self

    def method_configs(self) -> Dict[str, Any]:
        """The config of each method of the credit spec, as ``CreditPipeline(spec, configs)``
        takes them: ``credit_config``'s, with the ``credit_args`` shorthand merged on top.

        A :class:`ConfigError` for settings of a method that is not in the spec, an unknown
        method or field, a bad value, or a field that ``credit_config`` and ``credit_args`` set
        to two different values (the same value twice is allowed; ``credit_config`` counts as
        set where it differs from the method's default)."""
        from ..credit.registry import get_method
        from ..credit.spec import parse_spec

        spec = _spec_of(self.credit)
        try:
            names = [m.name for m in parse_spec(spec)]
        except (KeyError, ValueError) as e:
            raise ConfigError(f"credit: {one_line(e)}") from None
        section = self.credit_config
        for name in configured_methods(section):
            if name not in names:
                raise ConfigError(
                    f"credit_config.{name}: set, but {name} is not in the credit spec {spec!r} (its methods: {', '.join(names)})"
                )
        args = parse_credit_args(self.credit_args)
        for name, values in args.items():
            if name not in names:
                try:
                    get_method(name)
                except (KeyError, ValueError) as e:
                    raise ConfigError(f"credit_args: {one_line(e)}") from None
                raise ConfigError(
                    f"credit_args: {name}.{next(iter(values))}: {name} is not in the credit spec {spec!r} "
                    f"(its methods: {', '.join(names)})"
                )
        out = {}
        for name in names:
            cls = get_method(name).config_cls
            default = cls()
            current = getattr(section, name, None)
            current = default if current is None else current
            over = args.get(name, {})
            valid = [f.name for f in dataclasses.fields(cls)]
            obj = copy.copy(current)
            for k, v in over.items():
                if k not in valid:
                    raise ConfigError(f"credit_args: {name}.{k}: unknown field of {name}; expected one of {valid}")
                was = getattr(current, k)
                if _plain(was) != _plain(getattr(default, k)) and _plain(was) != _plain(v):
                    raise ConfigError(
                        f"credit_args: {name}.{k}={v!r} and credit_config.{name}.{k}={was!r} set one field to two "
                        f"values; set it in one place"
                    )
                object.__setattr__(obj, k, v)
            out[name] = _check_method_config(obj, name, f"credit_args: {name}" if over else f"credit_config.{name}")
        return out


def _check_device(device: str) -> None:
    """A ``device`` this torch cannot use (``cuda`` on a CPU-only build or with no GPU visible,
    ``cuda:N`` past the GPUs there are, ``mps`` off Apple silicon): one line before any model
    loads, instead of a traceback when the model is moved there."""
    import torch

    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if n == 0:
            raise ConfigError(f"device: expected auto or cpu (this torch {torch.__version__} sees no CUDA device), got {device!r}")
        if index >= n:
            raise ConfigError(f"device: expected auto, cpu, cuda or cuda:0{f'..cuda:{n - 1}' if n > 1 else ''} "
                              f"({n} CUDA device{'s' if n > 1 else ''}), got {device!r}")
    elif device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"device: expected auto or cpu (this torch {torch.__version__} has no MPS device), got 'mps'")


def _check_data_and_reward(cfg: "TrainConfig") -> None:
    """The own-data and reward settings that do not depend on the files (those are checked when
    the data loads, still before any model)."""
    d, r = cfg.data, cfg.reward
    if d.path is None:
        for name in ("eval_path", "eval_split", "eval_fraction", "answer_column", "system_prompt", "prompt_template"):
            if getattr(d, name) is not None:
                raise ConfigError(f"data.{name}: set, but data.path is not (own data needs data.path), got {brief_repr(getattr(d, name))}")
    elif cfg.task.path is not None:
        raise ConfigError(f"task.path: expected no task.path with data.path {brief_repr(d.path)} (own data), got {brief_repr(cfg.task.path)}")
    if d.eval_fraction is not None and (d.eval_path is not None or d.eval_split is not None):
        raise ConfigError(f"data.eval_fraction: expected no eval_fraction with data.eval_path or data.eval_split, got {d.eval_fraction}")
    if d.prompt_template is not None and "{prompt}" not in d.prompt_template:
        raise ConfigError(f"data.prompt_template: expected a text with {{prompt}} where the row's prompt goes, got {brief_repr(d.prompt_template)}")
    if r.weights and len(r.weights) != len(r.funcs):
        raise ConfigError(f"reward.weights: expected {len(r.funcs)} weights, one per reward.funcs entry, got {len(r.weights)}")
    if r.funcs and cfg.task.reward_fn is not None:
        raise ConfigError(f"task.reward_fn: expected either reward.funcs or task.reward_fn, got both ({brief_repr(cfg.task.reward_fn)})")
    for w in r.weights:
        if not math.isfinite(w):
            raise ConfigError(f"reward.weights: expected finite numbers, got {w}")


def credit_config_for(section: Any, credit: str) -> Any:
    """``section`` (a ``credit_config``) with every method outside ``credit``'s spec back at its
    defaults: one base config run under several specs (``compare``) sets each run's own."""
    from ..credit.spec import parse_spec

    names = {m.name for m in parse_spec(_spec_of(credit))}
    return dataclasses.replace(section, **{n: f.default_factory() for n, f in section.__dataclass_fields__.items() if n not in names})


def parse_credit_args(args) -> Dict[str, Dict[str, Any]]:
    """("taco.lam=0.5", "stare.variant=C2") -> {"taco": {"lam": 0.5}, "stare": {"variant": "C2"}}."""
    out: Dict[str, Dict[str, Any]] = {}
    for a in args:
        if not isinstance(a, str) or "=" not in a or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"credit_args: expected 'method.field=value', got {brief_repr(a)}")
        key, value = a.split("=", 1)
        method, name = key.split(".", 1)
        try:
            out.setdefault(method, {})[name] = load_yaml_bounded(value, f"credit_args: {key}")
        except yaml.YAMLError as e:
            raise ConfigError(f"credit_args: expected a YAML value after '=', got {brief_repr(a)} ({one_line(e)})") from None
    return out


#: recipes: a name usable as --credit that sets a credit spec plus overrides (the DAPO paper's)
RECIPES: Dict[str, Dict[str, Any]] = {
    "dapo": {
        "credit": "grpo",
        "loss": {"policy_loss": "ppo", "clip_low": 0.2, "clip_high": 0.28, "agg_mode": "token-mean", "kl_coef": 0.0},
        "dapo": {"dynamic_sampling": True, "overlong_shaping": True},
    },
}


def _from_dict(cls, data: Dict[str, Any], where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {unknown}; expected some of {sorted(fields)}")
    kw = {}
    for k, v in data.items():
        f = fields[k]
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub) and not isinstance(v, sub):
            kw[k] = _from_dict(sub, v, f"{where}.{k}" if where else k)
        elif isinstance(v, list):
            kw[k] = tuple(v)
        else:
            kw[k] = v
    if where.startswith("credit_config."):  # a method's config: its types, then its own checks
        obj = cls()
        for k, v in kw.items():
            object.__setattr__(obj, k, v)
        return _check_method_config(obj, where.split(".")[1], where)
    return cls(**kw)


def config_from_dict(data: Any, where: str = "config.json") -> TrainConfig:
    """The :class:`TrainConfig` that plain values hold (a run's ``config.json``, the inverse of
    :func:`config_to_dict`), each section and method setting checked for its type and range: a
    value that is not is a :class:`ConfigError` naming ``where`` and the field."""
    return _from_dict(TrainConfig, data, where)


def apply_recipe(cfg: TrainConfig) -> TrainConfig:
    """Expand a recipe name given as ``credit`` into its spec and settings.

    A recipe supplies defaults, not overrides: a field of ``cfg`` that differs from
    ``TrainConfig()``'s default was chosen by the user and is kept (``--credit dapo
    --loss.clip-high 0.3`` trains with 0.3). :func:`load_config` goes further and lets any value
    given in the YAML file or on the command line win, even one equal to the default.
    """
    recipe = RECIPES.get(cfg.credit)
    if recipe is None:
        return cfg
    d = dataclasses.asdict(cfg)
    default = dataclasses.asdict(TrainConfig())
    for k, v in recipe.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                if d[k][kk] == default[k][kk]:
                    d[k][kk] = vv
        else:
            d[k] = v
    return _from_dict(TrainConfig, d, "")


def _merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_method_flags(args: list) -> None:
    """An unknown method or field in a ``--credit-config.METHOD.FIELD`` flag: one line naming it
    and the valid choices (tyro's own message lists look-alike flags over many lines)."""
    methods = [f.name for f in dataclasses.fields(MethodConfigs)]
    for a in args:
        m = re.match(r"--credit[-_]config\.([^=]*)", a) if isinstance(a, str) else None
        if m is None:
            continue
        flag, parts = a.split("=", 1)[0], m.group(1).split(".")
        method = parts[0].replace("-", "_")
        if method not in methods:
            raise ConfigError(f"{flag}: unknown credit method {parts[0]!r}; expected one of {methods}")
        cls = getattr(MethodConfigs, "__dataclass_fields__")[method].default_factory
        valid = [f.name for f in dataclasses.fields(cls)]
        name = parts[1].replace("-", "_") if len(parts) == 2 else None
        negated = name is not None and name.startswith("no_") and name[3:] in valid
        if name not in valid and not negated:
            raise ConfigError(f"{flag}: unknown field of {method}; expected --credit-config.{method}.FIELD, FIELD one of {valid}")


def _first_paragraph(text: str) -> str:
    """The first paragraph of tyro's error message ("Error parsing --steps: invalid literal ...").
    tyro frames it in a box on a terminal (``╭─ Value error ─╮``, ``│ ... │`` lines, a ``─`` rule
    after the paragraph), or writes it plain (a title line, a ``-`` rule, the paragraph, a rule)."""
    framed = "╭" in text
    lines = [ln.strip().strip("│").strip() for ln in text.splitlines() if not ln.strip().startswith(("╭", "╰"))]

    def rule(ln: str) -> bool:
        return len(ln) > 3 and set(ln) <= {"─", "-"}

    if not framed and len(lines) > 1 and rule(lines[1]):  # plain: skip the title and its rule
        lines = lines[2:]
    out = []
    for ln in lines:
        if rule(ln) or (not ln and out):
            break
        if ln:
            out.append(ln)
    return " ".join(out)


def _parse_args(args: list, base: TrainConfig) -> TrainConfig:
    """tyro's parse of ``args`` on top of ``base``, with its errors as one-line ConfigErrors.

    Checks are deferred while tyro builds the config (tyro would turn them into a framed box)
    and run on the result."""
    import contextlib
    import io
    import sys

    import tyro

    _check_method_flags(args)
    err = io.StringIO()
    token = _DEFER_CHECKS.set(True)
    try:
        with contextlib.redirect_stderr(err):
            cfg = tyro.cli(TrainConfig, args=args, default=base, prog="tokencredit train")
    except SystemExit as e:
        text = err.getvalue()
        if e.code not in (0, None):
            first = _first_paragraph(text)
            if first:
                first = re.sub(r"^Error parsing ", "", first)
                # a method config's own check, run by tyro: "credit-config.taco: taco lam: expected ..."
                m = re.match(r"credit-config\.([\w-]+): (.*)", first)
                if m:
                    method = m.group(1).replace("-", "_")
                    first = _method_message(ValueError(m.group(2)), method, f"credit_config.{method}")
                raise ConfigError(first) from None
        sys.stderr.write(text)
        raise
    finally:
        _DEFER_CHECKS.reset(token)
    sys.stderr.write(err.getvalue())
    cfg.check_fields()
    return cfg


def load_config(path: Optional[str] = None, overrides: Optional[list] = None) -> TrainConfig:
    """YAML file (optional) as defaults, then command-line overrides parsed by tyro.

    Precedence: dataclass defaults < a recipe named by ``credit`` (e.g. ``dapo``) < the YAML file
    < the command line.
    """
    import tyro

    args = list(overrides or [])
    from_yaml: Dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: expected a YAML file, got {str(p)!r} ({'a directory' if p.exists() else 'no such file'})")
        try:
            from_yaml = load_yaml_bounded(p.read_text(), f"--config: {p}") or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config: {p} is not valid YAML ({one_line(e)})") from None
    base = _from_dict(TrainConfig, from_yaml, "")
    cfg = _parse_args(args, base)
    recipe = RECIPES.get(cfg.credit)
    if recipe is None:
        return cfg
    # parse again on top of the recipe, so that the file and the command line win over it
    with_recipe = _merge(dataclasses.asdict(TrainConfig()), {k: v for k, v in recipe.items() if k != "credit"})
    base = _from_dict(TrainConfig, _merge(with_recipe, from_yaml), "")
    cfg = _parse_args(args, base)
    return dataclasses.replace(cfg, credit=recipe["credit"])


def config_to_dict(cfg: TrainConfig) -> Dict[str, Any]:
    """``cfg`` as plain values (``config.json``). ``credit_config`` holds the settings each method
    of the spec runs with (``credit_args`` merged in, every field), and nothing of the other
    methods (a change of an unused method's defaults does not refuse a ``--resume``).
    ``_from_dict(TrainConfig, ...)`` reads it back to a config with the same
    :meth:`~TrainConfig.method_configs` and the same ``config_to_dict``. A config that does not
    validate is written as it is."""
    d = dataclasses.asdict(cfg)
    try:
        used = cfg.method_configs()
    except ValueError:
        return d
    # a method registered after this module was imported (a plugin) has no field: its settings
    # are its credit_args
    known = {f.name for f in dataclasses.fields(MethodConfigs)}
    d["credit_config"] = {name: dataclasses.asdict(c) for name, c in used.items() if name in known}
    return d


#: fields that a resumed run may change (top-level names or dotted paths): the budget and the
#: bookkeeping, none of which changes what a step computes. ``--steps`` may grow the run (under a
#: linear or cosine schedule the remaining steps follow the new length). Everything else must
#: equal the checkpoint's configuration; ``compare`` uses the same set to recognise its runs.
SAFE_TO_CHANGE = frozenset(
    {"steps", "resume", "overwrite", "output_dir", "save_every", "keep_last", "threads", "retain_memory", "device", "log", "model.cache_dir"}
)


#: fields added after runs were written, at the value under which such a run trains as it did
#: (fp32; one_pass gives the separate pass's values up to float rounding; a step of <= 64 rows
#: is still one generate call; generate's own multinomial sampler). A run written before a field
#: existed reads as having it at this value, so a resume names the value that continues it exactly.
LATER_FIELDS = {"precision": "fp32", "optim.one_pass": True, "rollout.max_batch_size": 64,
                "rollout.sampler": "multinomial", "rollout.backend": "hf", "rollout.enforce_eager": True}


def config_diff(saved: Dict[str, Any], new: Dict[str, Any], ignore=SAFE_TO_CHANGE, prefix: str = "") -> List[str]:
    """The differences between two configs as dicts (``config_to_dict``, or read back from JSON),
    one ``"field: old -> new"`` per field, leaving out the fields in ``ignore``.

    A method missing from one side's ``credit_config`` (``config_to_dict`` writes only the spec's;
    a config written before the section existed has none) reads as that method's defaults."""
    if not prefix and isinstance(saved, dict) and isinstance(new, dict):
        saved, new = _same_methods(saved, new)
        # a config written before the data / reward sections existed trained with their defaults
        for name, cls in (("data", DataConfig), ("reward", RewardConfig)):
            if name not in saved and name in new:
                saved = dict(saved, **{name: json.loads(json.dumps(dataclasses.asdict(cls())))})
    diffs = []
    for k in sorted(set(saved) | set(new)):
        if f"{prefix}{k}" in ignore:
            continue
        # a field added after the run was written reads as the value it trained with
        a = saved[k] if k in saved else LATER_FIELDS.get(f"{prefix}{k}")
        b = new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_diff(a, b, ignore, f"{prefix}{k}.")
        elif (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            diffs.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return diffs


def _same_methods(a: Dict[str, Any], b: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``a`` and ``b`` with the same methods in ``credit_config``: one missing on one side (or the
    whole section, in a config written before it existed) reads as that method's defaults."""
    ca, cb = a.get("credit_config", {}), b.get("credit_config", {})
    if not (isinstance(ca, dict) and isinstance(cb, dict)) or set(ca) == set(cb):
        return a, b
    from ..credit.registry import get_method

    defaults = {}
    for name in set(ca) ^ set(cb):
        try:
            defaults[name] = dataclasses.asdict(get_method(name).config_cls())
        except (KeyError, ValueError):
            pass  # not a method of this version: the difference is reported
    return dict(a, credit_config={**defaults, **ca}), dict(b, credit_config={**defaults, **cb})

