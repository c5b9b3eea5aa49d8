"""Checking a config value against its field: types, ranges, names, and bounded YAML.

* :class:`ConfigError`: the one-line error of a bad value, ``"field: expected X, got Y"``.
* :func:`check_section`: every field of a config dataclass against its annotation
  (``Optional``, ``Literal``, tuples, bool / int / float / str) and :data:`FIELD_RANGES`, and
  the names a string field refers to (a task, a policy loss, an aggregation, a KL estimator).
* :func:`load_yaml_bounded`: ``yaml.safe_load`` with its nesting depth and expanded size
  bounded before anything reads the value (no "billion laughs", no deep recursion), and a key
  given twice in one mapping refused (PyYAML would keep the last without a word).

Used by ``tokencredit.train.config`` (its sections, ``TrainConfig``, each method's config) and
re-exported there; nothing here knows the sections themselves.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Tuple

import yaml

from ..errors import ConfigError  # noqa: F401 (defined in errors; importable here too)

__all__ = ["ConfigError", "FIELD_RANGES", "YAML_MAX_DEPTH", "YAML_MAX_VALUES", "brief_repr", "check_section", "load_yaml_bounded"]


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
    # at most a day: a reward call's budget is waited for with poll(), which takes ~24 days at most
    "task.reward_timeout_s": _Range(0, 86400, lo_open=True), "task.n_train": _GE1,
    # >= 1: the run evaluates at its last step at least, and an empty split is no accuracy of 0
    "task.n_eval": _GE1,
    "data.eval_fraction": _Range(0, 1, lo_open=True, hi_open=True),
    "reward.max_failing_steps": _GE1, "reward.clipped_warn_ratio": _Range(0, 1, lo_open=True),
    "rollout.prompts_per_step": _GE1,
    "rollout.samples_per_prompt": _Range(2),  # group methods need a group
    "rollout.max_new_tokens": _GE1, "rollout.max_batch_size": _GE1, "rollout.temperature": _GE0, "rollout.top_p": _Range(0, 1, lo_open=True),
    "optim.lr": _GT0, "optim.weight_decay": _GE0, "optim.betas": _Range(0, 1, hi_open=True),
    "optim.warmup_steps": _GE0, "optim.max_grad_norm": _GT0, "optim.micro_batch_size": _GE1, "optim.ppo_epochs": _GE1,
    "loss.norm_constant": _GT0, "loss.clip_low": _Range(0, 1, hi_open=True), "loss.clip_high": _GE0,
    "loss.dual_clip": _Range(1, lo_open=True), "loss.kl_coef": _GE0, "loss.epsilon_high": _Range(1),
    "loss.clip_cov_ratio": _Range(0, 1, lo_open=True), "loss.kl_cov_ratio": _Range(0, 1, lo_open=True),
    "loss.ppo_kl_coef": _GE0, "loss.rollout_is_threshold": _GT0, "loss.rollout_rs_threshold": _GT0,
    "critic.lr": _GT0, "critic.steps": _GE1,
    "dapo.max_rounds": _GE1, "dapo.overlong_cache": _GE1,
    "log.eval_every": _GE1, "log.eval_samples": _GE0,
}


def _choices() -> Dict[str, list]:
    """The allowed values of the string fields that name something (looked up when validating)."""
    from ..credit.losses import AGG_MODES, list_policy_losses
    from ..credit.losses.kl import KL_KINDS
    from ..credit.losses.policy import IS_LEVELS
    from ..data.tasks import list_tasks

    return {
        "task.name": list_tasks(),
        "loss.policy_loss": list_policy_losses(),
        "loss.agg_mode": list(AGG_MODES),
        "loss.kl_estimator": list(KL_KINDS),
        "loss.importance_sampling_level": list(IS_LEVELS),
    }


def brief_repr(v: Any) -> str:
    """``v`` as an error message shows it: a bounded repr (nested and long values elided), at
    most 80 characters."""
    s = _REPR.repr(v)  # bounded: never the repr of a whole (aliased, huge) value
    return s if len(s) <= 80 else s[:77] + "..."


def _bounded_repr():
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 6, 6, 6, 6
    r.maxstring, r.maxother, r.maxlong = 80, 80, 80
    return r


_REPR = _bounded_repr()

#: bounds of a YAML document (a config file, a credit_args value): a config is a few dozen values
#: nested four levels deep; a document past these would take unbounded time or memory to expand
#: (nested aliases, "billion laughs") or to walk (deep nesting), so it is refused before any use
YAML_MAX_DEPTH = 32
YAML_MAX_VALUES = 10_000


class _YamlTooBig(Exception):
    pass


class _YamlDuplicate(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the nesting depth bounded while composing (it recurses)."""

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise _YamlTooBig(f"nesting deeper than {YAML_MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        _no_duplicate_keys(node)
        return super().construct_document(node)


def _no_duplicate_keys(root) -> None:
    """A key given twice in one mapping is refused (:class:`_YamlDuplicate`, naming its dotted
    path and lines: PyYAML keeps the last one without a word); a merge (``<<: *base``) overriding
    a key is no duplicate. Each node is walked once (aliases share theirs), so the walk is as
    long as the document."""
    walked, stack = set(), [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in walked:
            continue
        walked.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: Dict[str, int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":
                    stack.append((value, path))
                    continue
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                line = key.start_mark.line + 1
                if name is not None and name in seen:
                    raise _YamlDuplicate(f"key {'.'.join(path + (name,))!r} given twice (lines {seen[name]} and {line}); keep one")
                if name is not None:
                    seen[name] = line
                stack.append((value, path + (str(name),)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path + (str(i),)) for i, item in enumerate(node.value))


# YAML 1.2's floats: PyYAML follows YAML 1.1, where a float needs a dot, so `lr: 1e-6` would be
# the string "1e-6"; this loader reads 1e-6, 3E+2 and 1.5e-3 as floats (1.0 and 0.5 as before)
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _expanded_size_ok(value: Any) -> None:
    """Count the values of ``value`` as its users would see them (an alias counts each time it
    is used), stopping at :data:`YAML_MAX_VALUES`: the cost is bounded, whatever the document."""
    n, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        n += 1
        if n > YAML_MAX_VALUES:
            raise _YamlTooBig(f"more than {YAML_MAX_VALUES} values once its aliases are expanded")
        if depth > YAML_MAX_DEPTH:
            raise _YamlTooBig(f"nesting deeper than {YAML_MAX_DEPTH} levels")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, (list, tuple)):
            stack.extend((x, depth + 1) for x in v)


def load_yaml_bounded(text: str, where: str) -> Any:
    """``yaml.safe_load(text)`` with its depth and expanded size bounded (see
    :data:`YAML_MAX_DEPTH`, :data:`YAML_MAX_VALUES`); a :class:`ConfigError` naming ``where``."""
    try:
        value = yaml.load(text, Loader=_BoundedLoader)
        _expanded_size_ok(value)
    except _YamlTooBig as e:
        raise ConfigError(f"{where}: expected a config of at most {YAML_MAX_VALUES} values nested at most "
                          f"{YAML_MAX_DEPTH} levels, got {e}") from None
    except _YamlDuplicate as e:
        raise ConfigError(f"{where}: {e}") from None
    return value


def _type_ok(v: Any, tp: Any, finite: bool = True) -> Tuple[bool, str]:
    """Whether ``v`` has the annotated type ``tp``, and the type's name for the message.
    ``finite=False``: a float may be infinite (never NaN), as where a method's "off" is inf."""
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        ok, name = _type_ok(v, inner[0], finite)
        return v is None or ok, f"None or {name}"
    if origin is Literal:
        return v in args, "one of " + ", ".join(map(repr, args))
    if origin in (tuple, Tuple):
        if args and args[-1] is Ellipsis:
            ok, name = _type_ok(None, args[0], finite)
            plural = re.sub(r"^an? ", "", name) + "s"
            return isinstance(v, (tuple, list)) and all(_type_ok(x, args[0], finite)[0] for x in v), f"a list of {plural}"
        names = [_type_ok(None, a, finite)[1] for a in args]
        ok = isinstance(v, (tuple, list)) and len(v) == len(args) and all(_type_ok(x, a, finite)[0] for x, a in zip(v, args))
        return ok, f"a list of {len(args)} ({', '.join(names)})"
    if tp is bool:
        return isinstance(v, bool), "true or false"
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), "an integer"
    if tp is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (math.isfinite(v) if finite else not math.isnan(v))
        return ok, "a finite number" if finite else "a number"
    if tp is str:
        return isinstance(v, str) and v.strip() != "", "a non-empty string"
    return True, getattr(tp, "__name__", str(tp))


def check_section(section: Any, prefix: str = "", finite: bool = True) -> None:
    """Check every field of one config dataclass against its annotation and ``FIELD_RANGES``;
    raise :class:`ConfigError` naming the first bad field (``"optim.lr: expected ..., got ..."``).
    ``finite=False`` lets floats be infinite (a method config's own checks bound them)."""
    import typing

    hints = typing.get_type_hints(type(section))
    choices = None
    for f in dataclasses.fields(section):
        name, v, tp = f"{prefix}{f.name}", getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, tp):
                raise ConfigError(f"{name}: expected a {tp.__name__} (a mapping of its fields), got {brief_repr(v)}")
            continue
        ok, expected = _type_ok(v, tp, finite)
        rng = FIELD_RANGES.get(name)
        if ok and rng is not None and v is not None:
            ok = all(rng.holds(x) for x in (v if isinstance(v, (tuple, list)) else (v,)))
        if not ok:
            if rng is not None:
                expected += f" {rng.text()}" if not isinstance(v, (tuple, list)) and "list" not in expected else f", each {rng.text()}"
            raise ConfigError(f"{name}: expected {expected}, got {brief_repr(v)}")
        if isinstance(v, str):
            if choices is None:
                choices = _choices()
            if name in choices and v not in choices[name]:
                raise ConfigError(f"{name}: expected one of {choices[name]}, got {brief_repr(v)}")
