"""`--set FIELD=VALUE`: the text is converted by the config field's declared type, never guessed from its look
(`--set tie_embeddings=false` is False; the string 'false' would count as true).

Types read: bool (true/false, yes/no, on/off, 1/0), int, float (finite), str, and `X | None` (none/null -> None).
A field of any other type (e.g. a rope-scaling dataclass) can be set to none only.

Local stand-in for the shared field-type parser the base model config will offer (zoo/models/config.py): swap
`convert` for it when that lands. Imports nothing of JAX.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
_NONE = {"none", "null"}


def field_types(config_cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(config_cls)}


def convert(config_cls: type, name: str, text: str):
    """The value of `--set name=text` for `config_cls`; ValueError naming the field and its type if `text` is not
    one."""
    types_ = field_types(config_cls)
    if name not in types_:
        raise ValueError(f"--set {name}: not a field of {config_cls.__name__}; its fields: {', '.join(sorted(types_))}")
    return _convert(name, types_[name], text)


def _convert(name: str, tp, text: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        if type(None) in args and text.strip().lower() in _NONE:
            return None
        rest = [a for a in args if a is not type(None)]
        errors = []
        for a in rest:
            try:
                return _convert(name, a, text)
            except ValueError as e:
                errors.append(str(e))
        or_none = " (or none)" if type(None) in args else ""
        raise ValueError((errors[0] if len(errors) == 1 else f"--set {name}={text!r}: expected {_name(tp)}") + or_none)
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ValueError(f"--set {name}={text!r}: expected a bool (true/false, yes/no, on/off, 1/0)")
    if tp is int:
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"--set {name}={text!r}: expected an int") from None
    if tp is float:
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"--set {name}={text!r}: expected a number") from None
        if not math.isfinite(v):
            raise ValueError(f"--set {name}={text!r}: expected a finite number")
        return v
    if tp is str:
        return text
    raise ValueError(f"--set {name}={text!r}: a {_name(tp)} field cannot be set from the command line")


def _name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
