"""Checking a config dataclass's fields at run time: each value against its type annotation (`check_types`), the
names a caller gives against the fields (`check_field_names`: the closest ones named), and the ranges a config's
`check()` asks for (`check_positive`, `check_non_negative`, `check_positive_float`, `check_divides`). Every message
names the config class and the field; turning command-line text into values is the application's
(`recipes.train.settings.cli.parse_field`, with `field_types`, `type_options` and `type_name` from here).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

from zoo import checks
from zoo.names import did_you_mean


def type_options(hint) -> tuple[tuple[type, ...], bool]:
    """(the non-None types a hint allows, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return tuple(a for a in args if a is not type(None)), type(None) in args
    return (hint,), False


def _type_ok(value, allowed: tuple[type, ...]) -> bool:
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return True
        if t not in (bool, int, float) and isinstance(t, type) and isinstance(value, t):
            return True
    return False


def type_name(allowed: tuple[type, ...], optional: bool) -> str:
    """What a field of these types takes, for a message: "an int or None"."""
    names = {bool: "a bool", int: "an int", float: "a finite number", str: "a string"}
    out = " or ".join(names.get(t, f"a {t.__name__}") for t in allowed)
    return out + " or None" if optional else out


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """{field: resolved type annotation} of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_types(cfg) -> None:
    """ValueError naming the first field of the config dataclass instance `cfg` whose value its annotation refuses."""
    for name, hint in field_types(type(cfg)).items():
        allowed, optional = type_options(hint)
        value = getattr(cfg, name)
        if value is None and optional:
            continue
        if not _type_ok(value, allowed):
            raise ValueError(f"{type(cfg).__name__}.{name} must be {type_name(allowed, optional)}, got {value!r}")


def check_field_names(cls: type, names) -> None:
    """ValueError naming each of `names` that is not a field of the dataclass `cls`, with the closest field names
    (zoo.names) and every field; nothing for known names."""
    fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    unknown = [n for n in names if n not in fields]
    if not unknown:
        return
    def guess(n):
        return did_you_mean(n, fields, n=3)
    if len(unknown) == 1:
        what = f"{unknown[0]!r} is not a field of {cls.__name__}{guess(unknown[0])}"
    else:
        what = f"{', '.join(f'{n!r}{guess(n)}' for n in unknown)} are not fields of {cls.__name__}"
    raise ValueError(f"{what}; its fields: {', '.join(fields)}")


def check_positive(cfg, *fields: str) -> None:
    """ValueError unless each of `fields` of `cfg` is an int above zero (a bool is not)."""
    for f in fields:
        checks.check_positive(f"{type(cfg).__name__}.{f}", getattr(cfg, f), optional=False)


def check_non_negative(cfg, *fields: str) -> None:
    """ValueError unless each of `fields` of `cfg` is an int or float at least zero."""
    for f in fields:
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{type(cfg).__name__}.{f} must be non-negative, got {v!r}")


def check_positive_float(cfg, *fields: str) -> None:
    """ValueError unless each of `fields` of `cfg` is an int or float above zero."""
    for f in fields:
        checks.check_positive(f"{type(cfg).__name__}.{f}", getattr(cfg, f), float, optional=False)


def check_divides(cfg, small: str, big: str) -> None:
    """ValueError unless the field `small` of `cfg` divides the field `big`."""
    a, b = getattr(cfg, small), getattr(cfg, big)
    if b % a:
        raise ValueError(f"{type(cfg).__name__}.{small}={a} must divide {big}={b}")
