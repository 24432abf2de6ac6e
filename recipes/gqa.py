"""The recipe set of a grouped-query attention decoder (attention, then a SwiGLU MLP): the reference study's q, k, v
recipes, every matmul output kept in HBM or offloaded, the baselines, and the long-context pair. A family's set
(`recipes/<family name>.py`) starts from it and adds its own."""
from recipes.context import CONTEXT, context_recipes
from zoo import Recipe

QKV = ("query_proj", "key_proj", "value_proj")
# Every matmul output, and the kernel's statistics with its output: `minimal` recomputes only elementwise work.
MATMULS = QKV + CONTEXT + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")


def gqa_recipes(qkv: str) -> dict[str, Recipe]:
    """none, full, save_qkv, qkv_offload, qkv_context_offload, minimal, minimal_offload, context_save and
    context_offload; `qkv` says what the three offloaded tensors are in this family (e.g. "q, k, v after RoPE")."""
    return {
        "none": Recipe.none(),
        "full": Recipe.full(),
        "save_qkv": Recipe("save_qkv", device=QKV, description="the study's tensors kept in HBM (its on-device twin)"),
        "qkv_offload": Recipe("qkv_offload", offload=QKV,
                              description=f"the study's recipe: {qkv} to pinned host memory"),
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
