"""Recipes for Qwen3 (the dense models).

The reference study's recipe on Qwen3's GQA: the query, key and value projections (q and k after their per-head
norm and RoPE) offloaded to pinned host memory while the rest is recomputed, beside its on-device twin and the
baselines.
"""
from recipes.context import CONTEXT, context_recipes
from zoo import Recipe

QKV = ("query_proj", "key_proj", "value_proj")
MATMULS = QKV + CONTEXT + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")

DEFAULT = "qkv_offload"  # the study's recipe: what `--recipe` runs when not given
RECIPES: dict[str, Recipe] = {
    "none": Recipe.none(),
    "full": Recipe.full(),
    "save_qkv": Recipe("save_qkv", device=QKV, description="the study's tensors kept in HBM (its on-device twin)"),
    "qkv_offload": Recipe("qkv_offload", offload=QKV,
                          description="the study's recipe: q, k (after norm and RoPE) and v to pinned host memory"),
    "qkv_context_offload": Recipe("qkv_context_offload", offload=QKV + CONTEXT,
                                  description="q, k, v and the attention kernel's output and statistics to pinned "
                                              "host memory"),
    "minimal": Recipe("minimal", device=MATMULS,
                      description="every matmul output and the attention statistics kept in HBM"),
    "minimal_offload": Recipe("minimal_offload", offload=MATMULS,
                              description="every matmul output and the attention statistics offloaded to pinned "
                                          "host memory"),
    **context_recipes(),
}
