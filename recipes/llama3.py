"""Recipes for Llama 3.1.

The reference study offloads the query, key and value projections of Llama 3.1 405B (576 MiB per layer at
batch 2, seq 8192, bf16) to host memory and recomputes the rest: +2.9% over full remat on GB200 with the
latency-hiding scheduler, and the HBM freed goes to the batch.
"""
from recipes.context import CONTEXT, context_recipes
from zoo import Recipe

QKV = ("query_proj", "key_proj", "value_proj")
# Every matmul output, and the kernel's statistics with its output: `minimal` recomputes only elementwise work.
MATMULS = QKV + CONTEXT + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")

DEFAULT = "qkv_offload"  # the study's recipe: what `--recipe` runs when not given
RECIPES: dict[str, Recipe] = {
    "none": Recipe.none(),
    "full": Recipe.full(),
    "save_qkv": Recipe("save_qkv", device=QKV, description="the study's tensors kept in HBM (its on-device twin)"),
    "qkv_offload": Recipe("qkv_offload", offload=QKV,
                          description="the study's recipe: q, k, v after RoPE to pinned host memory"),
    "qkv_context_offload": Recipe("qkv_context_offload", offload=QKV + CONTEXT,
                                  description="q, k, v and the attention kernel's output and statistics to pinned "
                                              "host memory"),
    "minimal": Recipe("minimal", device=MATMULS,
                      description="every matmul output and the attention statistics kept in HBM"),
    "minimal_no_context": Recipe("minimal_no_context", device=tuple(t for t in MATMULS if t not in CONTEXT),
                                 description="every matmul output but the attention kernel's kept in HBM: the "
                                             "backward pass runs attention's forward again (less HBM than minimal)"),
    "minimal_offload": Recipe("minimal_offload", offload=MATMULS,
                              description="every matmul output and the attention statistics offloaded to pinned "
                                          "host memory"),
    **context_recipes(),
}
