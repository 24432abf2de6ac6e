"""Recipes for Qwen3 (the dense models).

The reference study's recipe on Qwen3's GQA: the query, key and value projections (q and k after their per-head
norm and RoPE) offloaded to pinned host memory while the rest is recomputed, beside its on-device twin and the
baselines.
"""
from recipes.gqa import gqa_recipes
from recipes.table import RecipeTable
from zoo import Recipe

__all__ = ["DEFAULT", "RECIPES"]

DEFAULT = "qkv_offload"  # the study's recipe: what `--recipe` runs when not given
"""The name of the recipe `--recipe` runs when not given."""
RECIPES: dict[str, Recipe] = RecipeTable("qwen3", gqa_recipes("q, k (after norm and RoPE) and v"))
"""Qwen3's recipes by name (the names `--recipe` takes); each `zoo.Recipe` says what it does in its
`description` (docs/recipes.md lists them)."""
