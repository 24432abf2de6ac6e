"""The recipes of a model family, by name: the front ends' lookup (`--recipe`).

The model table is `zoo.models.registry` (`family(name)`, `family_of(cfg)`); each family names the module that
holds its recipes (`family.recipes`, e.g. "recipes.llama3", exporting `RECIPES`). This module imports it.
"""
from __future__ import annotations

import importlib

from zoo import Recipe
from zoo.models.registry import Family


def recipes_of(family: Family) -> dict[str, Recipe]:
    """{name: Recipe} of the family (the `RECIPES` of its recipes module)."""
    return importlib.import_module(family.recipes).RECIPES


def recipe(family: Family, name: str | None) -> Recipe:
    """The family's recipe `name` (None: its default, the study's recipe). ValueError naming `--recipe`."""
    name = family.default_recipe if name is None else name
    named = recipes_of(family)
    if name not in named:
        raise ValueError(f"--recipe {name!r} is not a {family.name} recipe; choose one of: {', '.join(named)}")
    return named[name]
