"""Recipes for Qwen3-MoE.

The same two groups as DeepSeek-V3's study, on GQA: the attention projections (q and k after their per-head norm and
RoPE, v) and the routed experts' up-projections (gate and up, over the dispatched rows), offloaded to pinned host
memory while the rest is recomputed. One recipe covers every stack: a dense stack emits no moe_* tags and ignores
them.
"""
from recipes.context import CONTEXT, context_recipes
from recipes.gqa import QKV
from recipes.table import RecipeTable
from zoo import Recipe

__all__ = ["DEFAULT", "RECIPES"]

MOE_UP = ("moe_mlpwi_0", "moe_mlpwi_1")

DEFAULT = "qkv_moe_offload"  # what `--recipe` runs when not given
"""The name of the recipe `--recipe` runs when not given."""
# the family's recipes by name (a table: the other families' repeat its shape)
RECIPES: dict[str, Recipe] = RecipeTable("qwen3_moe", {
    "none": Recipe.none(),
    "full": Recipe.full(),
    "qkv_offload": Recipe("qkv_offload", offload=QKV,
                          description="the attention projections (q, k after norm and RoPE; v) to pinned host memory"),
    "moe_up_offload": Recipe("moe_up_offload", offload=MOE_UP,
                             description="the routed experts' gate and up projections to pinned host memory"),
    "qkv_moe_offload": Recipe("qkv_moe_offload", offload=QKV + MOE_UP,
                              description="both: the attention projections and the MoE up-projections to pinned "
                                          "host memory"),
    "qkv_context_moe_offload": Recipe("qkv_context_moe_offload", offload=QKV + CONTEXT + MOE_UP,
                                      description="qkv_moe_offload plus the attention output and statistics"),
    **context_recipes(longest=False),   # four divides neither 94 layers (235B) nor the tiny preset's stacks
})
"""Qwen3-MoE's recipes by name (the names `--recipe` takes); each `zoo.Recipe` says what it does in its
`description` (docs/recipes.md lists them)."""
