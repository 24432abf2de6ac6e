"""The recipes of a model family, by name: the front ends' lookup (`--recipe`).

The model families are `zoo.models.registry`'s (`family(name)`, `family_of(cfg)`); their recipe sets live here, in
`recipes/<family name>.py`, each exporting `RECIPES` ({name: Recipe}) and `DEFAULT` (the study's recipe, run when
`--recipe` is not given). The zoo never names this package.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from zoo import Recipe
from zoo.models.registry import FAMILIES, Family
from zoo.names import did_you_mean


def recipe_set(family: Family) -> ModuleType:
    """The module `recipes.<family name>`; ValueError if the family has none."""
    try:
        return importlib.import_module(f"{__package__}.{family.name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.{family.name}":
            raise
        raise ValueError(f"model family {family.name!r} has no recipes: add recipes/{family.name}.py with RECIPES "
                         f"and DEFAULT") from None


def recipes_of(family: Family) -> dict[str, Recipe]:
    """{name: Recipe} of the family (the `RECIPES` of its recipes module)."""
    return recipe_set(family).RECIPES


def default_recipe(family: Family) -> str:
    """The name of the family's study recipe (its recipes module's `DEFAULT`)."""
    return recipe_set(family).DEFAULT


def recipe(family: Family, name: str | None) -> Recipe:
    """The family's recipe `name` (None: its default, the study's recipe). ValueError naming `--recipe`."""
    name = default_recipe(family) if name is None else name
    named = recipes_of(family)
    if name not in named:
        others = [other for other in owners(name) if other != family.name]
        hint = f" (it is {' and '.join(others)}'s: --model {others[0]})" if others else did_you_mean(name, named)
        raise ValueError(f"--recipe {name!r} is not a {family.name} recipe{hint}; choose one of: {', '.join(named)}")
    return named[name]


def owners(name: str) -> list[str]:
    """The names of the model families (those with a recipes module) that have a recipe called `name`."""
    out = []
    for fam in FAMILIES.values():
        try:
            if name in recipes_of(fam):
                out.append(fam.name)
        except ValueError:   # a family without recipes
            continue
    return out
