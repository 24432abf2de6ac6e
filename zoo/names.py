"""Closest-match suggestions for a mistyped name (a flag, a model family, a preset, a recipe, a config field, a mesh
axis): one rule for every "did you mean", and no suggestion when nothing is close. Imports nothing of the zoo.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.7


def _score(name: str, choice: str) -> float:
    """difflib's ratio of the two names (case and leading dashes aside), averaged with its ratio of letters in any
    order, so that swapped letters (`tyni` for `tiny`) stay close."""
    m = difflib.SequenceMatcher(None, name.lstrip("-").lower(), choice.lstrip("-").lower())
    return (m.ratio() + m.quick_ratio()) / 2


def closest(name: str, choices: Iterable[str], n: int = 1, cutoff: float = CUTOFF) -> list[str]:
    """Up to `n` of `choices` nearest `name`, nearest first; none scoring under `cutoff` (0..1)."""
    scored = sorted(((_score(name, c), i, c) for i, c in enumerate(choices)), key=lambda t: (-t[0], t[1]))
    return [c for score, _, c in scored[:n] if score >= cutoff]


def did_you_mean(name: str, choices: Iterable[str], n: int = 1, quote: bool = False) -> str:
    """" (did you mean X?)" (or "X or Y" for `n` > 1; repr'd with `quote`) of the `closest` choices; "" when none
    is close."""
    close = closest(name, choices, n)
    return f" (did you mean {' or '.join(repr(c) if quote else c for c in close)}?)" if close else ""
