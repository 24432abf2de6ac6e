"""A family's recipe table: `RECIPES` of `recipes/<family name>.py`, a dict of {name: Recipe} that names what it
holds when asked for a name it lacks.

`RECIPES["qkv_ofload"]` raises `UnknownRecipe` listing the family's recipes and the closest name ("did you mean
'qkv_offload'?"). It is a KeyError, so `name in RECIPES` and `RECIPES.get(name)` behave as a dict's, and a
ValueError, as every refusal of bad input in the zoo is (a command line prints it as one line).
"""
from __future__ import annotations

from zoo import Recipe
from zoo.names import did_you_mean


class UnknownRecipe(KeyError, ValueError):
    """A name the family's recipe table lacks; its message lists the names (a KeyError's would be the name alone)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RecipeTable(dict[str, Recipe]):
    """{name: Recipe} of the family `family`."""

    def __init__(self, family: str, recipes: dict[str, Recipe]):
        super().__init__(recipes)
        self.family = family

    def __missing__(self, name):
        hint = did_you_mean(str(name), self, quote=True)
        raise UnknownRecipe(f"{name!r} is not a {self.family} recipe{hint}; the {self.family} recipes: "
                            f"{', '.join(self)}")
