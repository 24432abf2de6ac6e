"""The one positive-number check of the library: every caller that refuses a non-positive size or count uses it."""
from __future__ import annotations

import numbers
from typing import Any


def check_positive(name: str, value: Any, kind: type = int, *, optional: bool = True, hint: str = "") -> None:
    """Refuse anything but a positive int (or number) with a one-line ValueError naming it.

    A bool is refused although Python counts `True` as 1 (`tiles=True` is a mistake, not one tile).

    Args:
        name: what the message calls the value (a field, a flag, an argument).
        value: the value checked.
        kind: `int` (any integral number, NumPy's included) or `float` (any real number, ints included).
        optional: whether None passes (a value left unset).
        hint: words put after "must be a positive int" in the message, e.g. " (sequence tiles)".

    Raises:
        ValueError: "{name} must be a positive int{hint}, got {value!r}" ("number" for `kind=float`).

    Examples:
        >>> from zoo.checks import check_positive
        >>> check_positive("seq_tiles", 4)
        >>> check_positive("seq_tiles", True)
        Traceback (most recent call last):
        ...
        ValueError: seq_tiles must be a positive int, got True
    """
    if value is None and optional:
        return
    number = numbers.Real if kind is float else numbers.Integral
    if isinstance(value, bool) or not isinstance(value, number) or not value > 0:
        raise ValueError(f"{name} must be a positive {'number' if kind is float else 'int'}{hint}, got {value!r}")
