"""Training configuration: typed dataclasses, a YAML file, command-line overrides (tyro).

    tokencredit train --credit taco                          # embedded default, short run
    tokencredit train --config run.yaml --rollout.temperature 0.7 --steps 50

Defaults are sized for the embedded SmolLM2-135M-Instruct on 2 CPU cores: a short run that
finishes in about six minutes (357 s measured) and shows a learning signal on 1-digit multiplication.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

import yaml

__all__ = [
    "ModelConfig",
    "TaskConfig",
    "RolloutConfig",
    "OptimConfig",
    "LossConfig",
    "CriticConfig",
    "DapoConfig",
    "LogConfig",
    "TrainConfig",
    "load_config",
    "RECIPES",
    "ConfigError",
    "SAFE_TO_CHANGE",
    "config_diff",
]


#: set while the command line is parsed: TrainConfig checks itself once, after tyro is done
_DEFER_CHECKS: contextvars.ContextVar = contextvars.ContextVar("tokencredit_defer_checks", default=False)


class ConfigError(ValueError):
    """A configuration value of the wrong type or out of range (or a run directory that cannot
    take the run). The message is one line: ``"field: expected X, got Y"``."""


@dataclass(frozen=True)
class _Range:
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v) -> bool:
        if self.lo is not None and not (v > self.lo if self.lo_open else v >= self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi}")
        return " and ".join(parts)


_GE0, _GT0, _GE1 = _Range(0), _Range(0, lo_open=True), _Range(1)

#: the range of each numeric field, by dotted name. Every field is also checked against its type
#: annotation (ints are not floats or bools, floats are finite numbers, strings are non-empty).
FIELD_RANGES: Dict[str, _Range] = {
    "steps": _GE1, "seed": _Range(0, 2**32 - 1), "threads": _GE1, "save_every": _GE1, "keep_last": _GE1,
    "model.lora_r": _GE1, "model.lora_alpha": _GE1,
    "task.reward_timeout_s": _GT0, "task.n_train": _GE1,
    # >= 1: the run evaluates at its last step at least, and an empty split is no accuracy of 0
    "task.n_eval": _GE1,
    "rollout.prompts_per_step": _GE1,
    "rollout.samples_per_prompt": _Range(2),  # group methods need a group
    "rollout.max_new_tokens": _GE1, "rollout.temperature": _GE0, "rollout.top_p": _Range(0, 1, lo_open=True),
    "optim.lr": _GT0, "optim.weight_decay": _GE0, "optim.betas": _Range(0, 1, hi_open=True),
    "optim.warmup_steps": _GE0, "optim.max_grad_norm": _GT0, "optim.micro_batch_size": _GE1, "optim.ppo_epochs": _GE1,
    "loss.norm_constant": _GT0, "loss.clip_low": _Range(0, 1, hi_open=True), "loss.clip_high": _GE0,
    "loss.dual_clip": _Range(1, lo_open=True), "loss.kl_coef": _GE0,
    "critic.lr": _GT0, "critic.steps": _GE1,
    "dapo.max_rounds": _GE1, "dapo.overlong_cache": _GE1,
    "log.eval_every": _GE1, "log.eval_samples": _GE0,
}


def _choices() -> Dict[str, list]:
    """The allowed values of the string fields that name something (looked up when validating)."""
    from .losses import AGG_MODES, list_policy_losses
    from .losses.kl import KL_KINDS
    from .tasks import list_tasks

    return {
        "task.name": list_tasks(),
        "loss.policy_loss": list_policy_losses(),
        "loss.agg_mode": list(AGG_MODES),
        "loss.kl_estimator": list(KL_KINDS),
    }


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _one_line(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split())


def _type_ok(v: Any, tp: Any) -> Tuple[bool, str]:
    """Whether ``v`` has the annotated type ``tp``, and the type's name for the message."""
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        ok, name = _type_ok(v, inner[0])
        return v is None or ok, f"None or {name}"
    if origin is Literal:
        return v in args, "one of " + ", ".join(map(repr, args))
    if origin in (tuple, Tuple):
        if args and args[-1] is Ellipsis:
            ok, name = _type_ok(None, args[0])
            plural = re.sub(r"^an? ", "", name) + "s"
            return isinstance(v, (tuple, list)) and all(_type_ok(x, args[0])[0] for x in v), f"a list of {plural}"
        names = [_type_ok(None, a)[1] for a in args]
        ok = isinstance(v, (tuple, list)) and len(v) == len(args) and all(_type_ok(x, a)[0] for x, a in zip(v, args))
        return ok, f"a list of {len(args)} ({', '.join(names)})"
    if tp is bool:
        return isinstance(v, bool), "true or false"
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), "an integer"
    if tp is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok, "a finite number"
    if tp is str:
        return isinstance(v, str) and v.strip() != "", "a non-empty string"
    return True, getattr(tp, "__name__", str(tp))


def check_section(section: Any, prefix: str = "") -> None:
    """Check every field of one config dataclass against its annotation and ``FIELD_RANGES``;
    raise :class:`ConfigError` naming the first bad field (``"optim.lr: expected ..., got ..."``)."""
    import typing

    hints = typing.get_type_hints(type(section))
    choices = None
    for f in dataclasses.fields(section):
        name, v, tp = f"{prefix}{f.name}", getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, tp):
                raise ConfigError(f"{name}: expected a {tp.__name__} (a mapping of its fields), got {_show(v)}")
            continue
        ok, expected = _type_ok(v, tp)
        rng = FIELD_RANGES.get(name)
        if ok and rng is not None and v is not None:
            ok = all(rng.holds(x) for x in (v if isinstance(v, (tuple, list)) else (v,)))
        if not ok:
            if rng is not None:
                expected += f" {rng.text()}" if not isinstance(v, (tuple, list)) and "list" not in expected else f", each {rng.text()}"
            raise ConfigError(f"{name}: expected {expected}, got {_show(v)}")
        if isinstance(v, str):
            if choices is None:
                choices = _choices()
            if name in choices and v not in choices[name]:
                raise ConfigError(f"{name}: expected one of {choices[name]}, got {_show(v)}")


@dataclass
class ModelConfig:
    name: str = "embedded:smollm2-135m-instruct"  # or any hub id / local path
    cache_dir: Optional[str] = None  # where the embedded GGUF is converted once ($TOKENCREDIT_CACHE)
    lora: bool = False  # ARCA requires LoRA
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    reference: Optional[str] = None  # frozen reference model for KL / divergence ("self" = initial policy)
    teacher: Optional[str] = None  # frozen teacher for OPD / OPPO teacher-oracle


@dataclass
class TaskConfig:
    name: str = "mul1"  # add1, add2, mul1, word, mix, gsm8k, math
    path: Optional[str] = None  # local jsonl/parquet for gsm8k/math
    reward_fn: Optional[str] = None  # "package.module:function", replaces the task's reward
    reward_timeout_s: float = 5.0
    n_train: int = 512
    n_eval: int = 32


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4
    samples_per_prompt: int = 4  # K, the group size
    max_new_tokens: int = 32
    temperature: float = 0.7  # ecosystem: T=1.0 removes almost all signal on a 135M model
    top_p: float = 1.0


@dataclass
class OptimConfig:
    lr: float = 2e-6
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8  # responses per forward/backward; gradients accumulate over the batch
    ppo_epochs: int = 1
    # torch's fused AdamW kernel (one pass over each parameter instead of a dozen foreach
    # kernels: 0.16 s against 0.67 s per step for SmolLM2-135M on one CPU thread); the update is
    # the same algorithm. Turned off by hand, or automatically on devices without the kernel.
    fused_adamw: bool = True


@dataclass
class LossConfig:
    policy_loss: str = "ppo"  # ppo | sapo (tokencredit.losses registry)
    # None = the policy loss's own default: token-mean for ppo (verl's default, DAPO's token-level
    # loss), seq-mean-token-mean for sapo (as verl hard-codes it)
    agg_mode: Optional[str] = None
    norm_constant: Optional[float] = None  # C of seq-mean-token-sum-norm (Dr. GRPO: the generation budget); None = padded length
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher, also TACO's and STARE's recipe
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0  # TACO/DAPO recipe: no KL
    kl_estimator: str = "k3"


@dataclass
class CriticConfig:
    """Value head for gae and pact (a linear head on the policy's detached final hidden states)."""

    lr: float = 1e-3
    steps: int = 1  # critic optimisation steps per training step
    # PACT's importance-sampling range is PACT's own setting: --credit-args pact.is_low=... pact.is_high=...


@dataclass
class DapoConfig:
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, regenerate to fill
    max_rounds: int = 3  # bounded regeneration
    overlong_shaping: bool = False
    # C: the penalty ramps over the last C tokens before max_new_tokens. None = max_new_tokens // 5,
    # the DAPO paper's proportion (a 4096-token cache on a 20480-token maximum)
    overlong_cache: Optional[int] = None


@dataclass
class LogConfig:
    eval_every: int = 10
    # evaluate once before the first step (logged as step 0): the baseline a run's curves start from
    eval_at_start: bool = True
    eval_samples: int = 4  # k for mean@k
    save_rollouts: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "tokencredit"
    progress: bool = True


@dataclass
class TrainConfig:
    credit: str = "grpo"  # a credit spec ("grpo+taco", "oppo+stare") or a recipe ("dapo")
    # method hyperparameters as "method.field=value" (values parsed as YAML): taco.lam=0.5 stare.P=0.2
    credit_args: Tuple[str, ...] = ()
    steps: int = 30  # training steps (a rollout batch and an update each); a resume may raise it
    seed: int = 0
    output_dir: str = "runs/default"
    device: str = "auto"  # auto | cpu | cuda
    threads: Optional[int] = None  # torch intra-op threads on CPU
    save_every: int = 10
    keep_last: int = 2
    resume: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    dapo: DapoConfig = field(default_factory=DapoConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self):
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
            raise ConfigError(f"device: expected auto, cpu, cuda, cuda:N or mps, got {_show(self.device)}")
        rf = self.task.reward_fn
        if rf is not None and not re.fullmatch(r"[^:]+:[\w.]+", rf):
            raise ConfigError(f"task.reward_fn: expected 'package.module:function' or 'file.py:function', got {_show(rf)}")
        if self.dapo.overlong_cache is not None and self.dapo.overlong_cache > self.rollout.max_new_tokens:
            raise ConfigError(
                f"dapo.overlong_cache: expected <= rollout.max_new_tokens ({self.rollout.max_new_tokens}), "
                f"got {self.dapo.overlong_cache}"
            )
        parse_credit_args(self.credit_args)
        from .spec import parse_spec

        try:
            parse_spec(RECIPES[self.credit]["credit"] if self.credit in RECIPES else self.credit)
        except (KeyError, ValueError) as e:
            raise ConfigError(
                f"credit: expected a credit spec (e.g. 'grpo+taco') or a recipe ({', '.join(sorted(RECIPES))}), "
                f"got {_show(self.credit)}: {_one_line(e)}"
            ) from None

    def validate(self) -> "TrainConfig":
        """Everything :meth:`check_fields` checks, plus the method settings of ``credit_args``
        against the spec. Called before any model is loaded (``Trainer``, the command line)."""
        self.check_fields()
        from .spec import CreditPipeline

        spec = RECIPES[self.credit]["credit"] if self.credit in RECIPES else self.credit
        try:
            CreditPipeline(spec, parse_credit_args(self.credit_args))
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"credit_args: {_one_line(e)}") from None
        return self


def parse_credit_args(args) -> Dict[str, Dict[str, Any]]:
    """("taco.lam=0.5", "stare.variant=C2") -> {"taco": {"lam": 0.5}, "stare": {"variant": "C2"}}."""
    out: Dict[str, Dict[str, Any]] = {}
    for a in args:
        if not isinstance(a, str) or "=" not in a or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"credit_args: expected 'method.field=value', got {_show(a)}")
        key, value = a.split("=", 1)
        method, name = key.split(".", 1)
        try:
            out.setdefault(method, {})[name] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"credit_args: expected a YAML value after '=', got {_show(a)} ({_one_line(e)})") from None
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
        if sub is not None and dataclasses.is_dataclass(sub):
            kw[k] = _from_dict(sub, v, f"{where}.{k}" if where else k)
        elif isinstance(v, list):
            kw[k] = tuple(v)
        else:
            kw[k] = v
    return cls(**kw)


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


def _parse_args(args: list, base: TrainConfig) -> TrainConfig:
    """tyro's parse of ``args`` on top of ``base``, with its errors as one-line ConfigErrors.

    Checks are deferred while tyro builds the config (tyro would turn them into a framed box)
    and run on the result."""
    import contextlib
    import io
    import sys

    import tyro

    err = io.StringIO()
    token = _DEFER_CHECKS.set(True)
    try:
        with contextlib.redirect_stderr(err):
            cfg = tyro.cli(TrainConfig, args=args, default=base, prog="tokencredit train")
    except SystemExit as e:
        text = err.getvalue()
        if e.code not in (0, None):
            # the framed message's first paragraph: "Error parsing --steps: invalid literal ..."
            box = [ln.strip().strip("│").strip() for ln in text.splitlines() if ln.strip().startswith("│")]
            first = " ".join(b for b in box[: next((i for i, b in enumerate(box) if b.startswith("─")), len(box))] if b)
            if first:
                raise ConfigError(re.sub(r"^Error parsing ", "", first)) from None
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
            from_yaml = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config: {p} is not valid YAML ({_one_line(e)})") from None
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
    return dataclasses.asdict(cfg)


#: fields that a resumed run may change (top-level names or dotted paths): the budget and the
#: bookkeeping, none of which changes what a step computes. ``--steps`` may grow the run (under a
#: linear or cosine schedule the remaining steps follow the new length). Everything else must
#: equal the checkpoint's configuration; ``compare`` uses the same set to recognise its runs.
SAFE_TO_CHANGE = frozenset(
    {"steps", "resume", "output_dir", "save_every", "keep_last", "threads", "device", "log", "model.cache_dir"}
)


def config_diff(saved: Dict[str, Any], new: Dict[str, Any], ignore=SAFE_TO_CHANGE, prefix: str = "") -> List[str]:
    """The differences between two configs as dicts (``config_to_dict``, or read back from JSON),
    one ``"field: old -> new"`` per field, leaving out the fields in ``ignore``."""
    diffs = []
    for k in sorted(set(saved) | set(new)):
        if f"{prefix}{k}" in ignore:
            continue
        a, b = saved.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_diff(a, b, ignore, f"{prefix}{k}.")
        elif (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            diffs.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return diffs
