"""Recipes for Llama 3.1.

The reference study offloads the query, key and value projections of Llama 3.1 405B (576 MiB per layer at
batch 2, seq 8192, bf16) to host memory and recomputes the rest: +2.9% over full remat on GB200 with the
latency-hiding scheduler, and the HBM freed goes to the batch.
"""
from recipes.context import CONTEXT
from recipes.gqa import MATMULS, gqa_recipes
from recipes.table import RecipeTable
from zoo import Recipe

__all__ = ["DEFAULT", "RECIPES"]

DEFAULT = "qkv_offload"  # the study's recipe: what `--recipe` runs when not given
"""The name of the recipe `--recipe` runs when not given."""
RECIPES: dict[str, Recipe] = RecipeTable("llama3", {
    **gqa_recipes("q, k, v after RoPE"),
    "minimal_no_context": Recipe("minimal_no_context", device=tuple(t for t in MATMULS if t not in CONTEXT),
                                 description="every matmul output but the attention kernel's kept in HBM: the "
                                             "backward pass runs attention's forward again (less HBM than minimal)"),
})
"""Llama 3.1's recipes by name (the names `--recipe` takes); each `zoo.Recipe` says what it does in its
`description` (docs/recipes.md lists them)."""
