"""Recipes for Llama 3.1.

The reference study offloads the query, key and value projections of Llama 3.1 405B (576 MiB per layer at
batch 2, seq 8192, bf16) to host memory and recomputes the rest: +2.9% over full remat on GB200 with the
latency-hiding scheduler, and the HBM freed goes to the batch.
"""
from zoo import Recipe

QKV = ("query_proj", "key_proj", "value_proj")
MATMULS = QKV + ("attention_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")

DEFAULT = "qkv_offload"  # the study's recipe: what `--recipe` runs when not given
RECIPES: dict[str, Recipe] = {
    "none": Recipe.none(),
    "full": Recipe.full(),
    "save_qkv": Recipe("save_qkv", device=QKV, description="the study's tensors kept in HBM (its on-device twin)"),
    "qkv_offload": Recipe("qkv_offload", offload=QKV,
                          description="the study's recipe: q, k, v after RoPE to pinned host memory"),
    "minimal": Recipe("minimal", device=MATMULS, description="every matmul output kept in HBM"),
    "minimal_offload": Recipe("minimal_offload", offload=MATMULS,
                              description="every matmul output offloaded to pinned host memory"),
}
