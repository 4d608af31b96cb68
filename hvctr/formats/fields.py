"""What a JSON record hvctr reads (a manifest) must hold before any of it is used: the one check.

    CHECKPOINT = {"seq": int, "chain": [int], "state": Exact({"step": int, ...}), "train_dir": Opt(str)}
    problem = field_problem(manifest, CHECKPOINT)   # '' or "key 'state.step': expected an integer, got '5' (a string)"

A manifest's own checksum proves only that nobody changed it since it was sealed, and anyone can
reseal one; its readers then index it (``m["model"]["dim"]``) and raised KeyError or TypeError
tracebacks at a missing key or a value of another type. A spec names the keys a reader uses
and the JSON type of each: ``int`` (never a bool), ``float`` (a finite number: an integer is
one), ``str``, ``bool``, ``dict`` or ``list`` (of anything), a dict of specs (an object with at
least those keys), ``Exact`` (those keys and no other), a one-element list (every element of
that spec), ``Opt(spec)`` (the key may be missing or null), ``OneOf(values)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class Exact(dict):
    """An object spec whose keys are all the object may hold (it is passed as keyword arguments)."""


@dataclass(frozen=True)
class Opt:
    spec: Any  # the key may be missing, or null


@dataclass(frozen=True)
class OneOf:
    values: tuple[Any, ...]


_NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false", dict: "an object",
          list: "a list"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
            list: "a list"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}... ({_kind(value)})" if len(text) > 60 else f"{text} ({_kind(value)})"


def field_problem(value: Any, spec: Any, key: str = "") -> str:
    """'' when ``value`` holds what ``spec`` says; else the first key that does not, and why."""
    where = f"key {key!r}" if key else "the record"
    if isinstance(spec, Opt):
        return "" if value is None else field_problem(value, spec.spec, key)
    if isinstance(spec, OneOf):
        return "" if value in spec.values else f"{where}: {value!r} is not one of {list(spec.values)}"
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where}: expected an object, got {_shown(value)}"
        for name, sub in spec.items():
            if name not in value and not isinstance(sub, Opt):
                return f"key {_join(key, name)!r} is missing"
            problem = field_problem(value.get(name), sub, _join(key, name))
            if problem:
                return problem
        extra = sorted(set(value) - set(spec)) if isinstance(spec, Exact) else []
        return f"{where}: unknown key(s) {extra}; it holds {sorted(spec)}" if extra else ""
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"{where}: expected a list, got {_shown(value)}"
        for i, item in enumerate(value):
            problem = field_problem(item, spec[0], f"{key}[{i}]")
            if problem:
                return problem
        return ""
    ok = (type(value) is int if spec is int
          else type(value) in (int, float) and math.isfinite(value) if spec is float
          else isinstance(value, spec))
    return "" if ok else f"{where}: expected {_NAMES[spec]}, got {_shown(value)}"


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name
