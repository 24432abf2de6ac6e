"""The long-context recipes every family's set holds: the attention kernel's two residuals (its output
`attention_out` and its softmax statistics `context`) kept in HBM or sent to pinned host memory, everything else
recomputed. Keeping both leaves no attention forward in the backward pass, whose cost grows as the square of the
sequence while their bytes grow as the sequence (docs/long-context.md)."""
from zoo import Recipe
from zoo.recipe import ATTENTION_RESIDUALS as CONTEXT


def context_recipes(kernel: str = "the attention kernel's") -> dict[str, Recipe]:
    """{"context_save": ..., "context_offload": ...} for a family whose attention is described as `kernel`."""
    return {
        "context_save": Recipe("context_save", device=CONTEXT,
                               description=f"{kernel} output and softmax statistics kept in HBM: no attention "
                                           f"forward in the backward pass"),
        "context_offload": Recipe("context_offload", offload=CONTEXT,
                                  description=f"{kernel} output and softmax statistics to pinned host memory: long "
                                              f"context's recipe (attention recompute grows as S^2)"),
    }
