"""Recipes for DeepSeek-V3.

The reference study offloads DeepSeek-V3 671B's MLA query and key/value projections and its MoE up-projections
to host memory and recomputes the rest: 57% faster than full remat on GB200 (NVLink-C2C, 450 GB/s a direction)
at the same batch, and the HBM freed runs 4x the batch of keeping those tensors on device. One recipe covers
both stacks: the dense stack emits no moe_* tags and simply ignores them.

On a slower link (the H200's PCIe: ~55 GB/s) the study's ~192 KiB/token/layer cannot hide behind the compute;
the low-rank recipes move the small MLA latents instead and recompute the up-projections from them (docs/benchmarks).
"""
from recipes.context import CONTEXT, context_recipes
from recipes.table import RecipeTable
from zoo import Recipe

__all__ = ["DEFAULT", "RECIPES"]

MLA_QKV = ("query_proj", "key_proj", "value_proj")
MOE_UP = ("moe_mlpwi_0", "moe_mlpwi_1")
STUDY = MLA_QKV + MOE_UP

DEFAULT = "mla_moe_offload"  # the study's recipe: what `--recipe` runs when not given
"""The name of the recipe `--recipe` runs when not given."""
# the family's recipes by name (a table: the other families' repeat its shape)
RECIPES: dict[str, Recipe] = RecipeTable("deepseek_v3", {
    "none": Recipe.none(),
    "full": Recipe.full(),
    "save_mla_moe": Recipe("save_mla_moe", device=STUDY,
                           description="the study's tensors kept in HBM (its on-device twin)"),
    "mla_moe_offload": Recipe("mla_moe_offload", offload=STUDY,
                              description="the study's recipe: MLA q, k, v and the MoE up-projections to pinned "
                                          "host memory"),
    "lowrank_offload": Recipe("lowrank_offload", offload=("mla_q", "mla_kv") + MOE_UP,
                              description="the normed MLA latents and the MoE up-projections to pinned host "
                                          "memory: ~1/3 of the study's bytes, for slower links"),
    "lowrank_wa_offload": Recipe("lowrank_wa_offload", offload=("query_wa_proj", "kv_wa_proj") + MOE_UP,
                                 description="the MLA down-projections (before their norms; kv_wa_proj holds the "
                                             "rope key too) and the MoE up-projections to pinned host memory: the "
                                             "low-rank recipe measured in docs/benchmarks; the backward pass "
                                             "recomputes no down-projection"),
    "lowrank_context_offload": Recipe("lowrank_context_offload",
                                      offload=("query_wa_proj", "kv_wa_proj") + MOE_UP + CONTEXT,
                                      description="lowrank_wa_offload plus the attention output and statistics"),
    **context_recipes("MLA's", grouped=False),   # its stacks (3 dense, 58 MoE layers) share no group size
})
"""DeepSeek-V3's recipes by name (the names `--recipe` takes); each `zoo.Recipe` says what it does in its
`description` (docs/recipes.md lists them)."""
