"""The search space: a TOML file of config keys, each a range or a list of choices.

    [trial]
    steps = 600          # train.max_steps of a trial's last evaluation (a subset of the data)
    evals = 4            # validation passes per trial, every steps / evals steps: the pruner's rungs
    ranks = 2            # ranks of each trial's hvctr train

    [params]
    "train.dense_lr" = { low = 1e-4, high = 3e-2, log = true }
    "train.sparse_lr" = { low = 1e-4, high = 3e-2, log = true }
    "merge.every_k_steps" = { choices = [1, 2, 4, 8, 16] }
    "storage.dim" = { low = 4, high = 32, step = 4 }
    "model.hidden" = { choices = [[64, 32], [256, 128]] }

A range is int when the config key is an int (its low, high and step TOML integers), else
float (finite numbers); ``log`` samples it on a log scale, ``step`` on a grid. A choice that is a list (model.hidden) travels as "a,b" (Optuna's
categorical values are scalars). Every key and every bound is checked against hvctr.config at
load: a typo or a value the config refuses is an error before any trial runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvctr.config import _field_types, _sections, load_config
from hvctr.formats.tomlfile import read_toml

TRIAL_KEYS = {"steps": int, "evals": int, "ranks": int}


@dataclass(frozen=True)
class Param:
    key: str  # section.key
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] | None = None
    is_int: bool = False

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.is_int:
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def override(self, value: Any) -> str:
        return f"--{self.key}={value}"

    def value_in(self, cfg) -> Any:
        """This key's value in a loaded config, as a trial would hold it (enums by value, lists as "a,b")."""
        section, name = self.key.split(".", 1)
        v = getattr(getattr(cfg, section), name)
        v = getattr(v, "value", v)
        return _choice(list(v)) if isinstance(v, (list, tuple)) else v

    def holds(self, value: Any) -> bool:
        """``value`` is one this parameter can take (among the choices; within the range, on its step)."""
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            return False
        return not self.step or abs((value - self.low) / self.step - round((value - self.low) / self.step)) < 1e-9


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    steps: int
    evals: int
    ranks: int

    def baseline(self, cfg) -> tuple[dict[str, Any] | None, str]:
        """The base config's value of every parameter, as one trial (the search's reference point:
        with it first, the best trial is at least the config the user already has), or None and
        why not: a base value the space cannot take."""
        values = {p.key: p.value_in(cfg) for p in self.params}
        outside = [f"{k} = {v!r}" for p, (k, v) in zip(self.params, values.items()) if not p.holds(v)]
        if outside:
            return None, f"the base config's {', '.join(outside)} lies outside the search space"
        return values, ""

    def eval_steps(self) -> list[int]:
        """train.max_steps of each evaluation: evenly spaced, the last at ``steps``."""
        return [round(self.steps * (i + 1) / self.evals) for i in range(self.evals)]


def _choice(v: Any) -> Any:
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    if isinstance(v, (bool, int, float, str)):
        return v
    raise ValueError(f"choice {v!r}: a number, a string, true/false or a list of them")


def _param(key: str, spec: Any, where: str) -> Param:
    if "." not in key:
        raise ValueError(f"{where}: parameter {key!r}: expected section.key (e.g. train.dense_lr)")
    section, name = key.split(".", 1)
    sections = _sections()
    if section not in sections or name not in _field_types(sections[section]):
        valid = sorted(f"{s}.{k}" for s, cls in sections.items() for k in _field_types(cls))
        raise ValueError(f"{where}: parameter {key!r} is not a config key; valid keys: {', '.join(valid)}")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: parameter {key!r}: expected {{ low = .., high = .. }} or {{ choices = [..] }}")
    unknown = set(spec) - {"low", "high", "log", "step", "choices"}
    if unknown:
        raise ValueError(f"{where}: parameter {key!r}: unknown field(s) {sorted(unknown)}; valid: low, high, log, "
                         f"step, choices")
    if "choices" in spec:
        if not isinstance(spec["choices"], list) or not spec["choices"] or len(spec) > 1:
            raise ValueError(f"{where}: parameter {key!r}: choices must be a non-empty list, alone")
        p = Param(key, choices=tuple(_choice(v) for v in spec["choices"]))
        for v in p.choices:
            _check_value(p, v, where)
        return p
    if "low" not in spec or "high" not in spec:
        raise ValueError(f"{where}: parameter {key!r}: a range needs low and high")
    is_int = _field_types(sections[section])[name] is int
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
    kind = "an integer" if is_int else "a finite number"
    for what, v in (("low", low), ("high", high), *((("step", step),) if step is not None else ())):
        if not _is_number(v, is_int):  # inf and nan too: Optuna cannot sample them (OverflowError)
            raise ValueError(f"{where}: parameter {key!r}: {what} must be {kind} ({key} takes "
                             f"{'integers' if is_int else 'numbers'}), got {v!r}")
    if low >= high:
        raise ValueError(f"{where}: parameter {key!r}: low {low!r} must be below high {high!r}")
    if not isinstance(log, bool):
        raise ValueError(f"{where}: parameter {key!r}: log must be true or false, got {log!r}")
    if step is not None and step <= 0:
        raise ValueError(f"{where}: parameter {key!r}: step must be > 0, got {step!r}")
    if log and low <= 0:
        raise ValueError(f"{where}: parameter {key!r}: a log range needs low > 0, got {low!r}")
    if log and step:
        raise ValueError(f"{where}: parameter {key!r}: log and step do not go together (Optuna)")
    p = Param(key, low=low, high=high, log=log, step=step, is_int=is_int)
    for v in (low, high):
        _check_value(p, v, where)
    return p


def _is_number(v: Any, integer: bool) -> bool:
    """``v`` is a TOML integer (``integer``), else a finite TOML number; never a bool."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) if integer else math.isfinite(v)


def _check_value(p: Param, value: Any, where: str) -> None:
    """hvctr.config accepts ``value`` for the key (type, range), or the error names both."""
    try:
        load_config(None, [p.override(value)])
    except ValueError as e:
        raise ValueError(f"{where}: parameter {p.key!r}, value {value!r}: {e}") from None


def load_space(path: str | Path) -> Space:
    path = Path(path)
    return space_from_dict(read_toml(path, "search space"), str(path))


def space_from_dict(raw: dict[str, Any], where: str = "search space") -> Space:
    unknown = set(raw) - {"trial", "params"}
    if unknown:
        raise ValueError(f"{where}: unknown section(s) {sorted(unknown)}; valid: [trial], [params]")
    trial = raw.get("trial", {})
    for k, v in trial.items():
        if k not in TRIAL_KEYS:
            raise ValueError(f"{where}: unknown key trial.{k}; valid: {sorted(TRIAL_KEYS)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}: trial.{k} must be an integer >= 1, got {v!r}")
    params = tuple(_param(k, v, where) for k, v in raw.get("params", {}).items())
    if not params:
        raise ValueError(f"{where}: [params] is empty: name at least one config key to search")
    space = Space(params, steps=trial.get("steps", 400), evals=trial.get("evals", 4), ranks=trial.get("ranks", 2))
    if space.evals > space.steps:
        raise ValueError(f"{where}: trial.evals {space.evals} > trial.steps {space.steps}")
    return space
