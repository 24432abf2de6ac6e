"""The long-context recipes every family's set holds: the attention kernel's two residuals (its output
`attention_out` and its softmax statistics `context`) kept in HBM or sent to pinned host memory, everything else
recomputed. Keeping both leaves no attention forward in the backward pass, whose cost grows as the square of the
sequence while their bytes grow as the sequence (docs/long-context.md).

Past 64K the limit is where every byte lives: the `_tiles` recipes run each layer's per-position parts in
`TILES` sequence tiles (`zoo.layers.tiles`), and `long_context` also keeps the layer input once per two layers,
in pinned host memory; `longest_context` once per four, each group's layers keeping the kernel's two residuals only
while the group's backward pass runs (two-level checkpoints), and `lead_context` as it, the first layer of each group
keeping them between the passes too (one attention forward fewer per group). A family whose stacks two does not
divide leaves them out; a model whose layers four does not divide refuses the last two by name.
"""
from zoo import Recipe
from zoo.recipe import ATTENTION_RESIDUALS as CONTEXT

CARRY = ("decoder_layer_input",)
TILES = 16


def context_recipes(kernel: str = "the attention kernel's", *, grouped: bool = True, longest: bool = True
                    ) -> dict[str, Recipe]:
    """{"context_save", "context_offload", "context_tiles", "context_offload_tiles" and, with `grouped`,
    "long_context" and (with `longest`) "longest_context" and "lead_context"} for a family whose attention is described
    as `kernel`."""
    out = {
        "context_save": Recipe("context_save", device=CONTEXT,
                               description=f"{kernel} output and softmax statistics kept in HBM: no attention "
                                           f"forward in the backward pass"),
        "context_offload": Recipe("context_offload", offload=CONTEXT,
                                  description=f"{kernel} output and softmax statistics to pinned host memory: long "
                                              f"context's recipe (attention recompute grows as S^2)"),
        "context_tiles": Recipe("context_tiles", device=CONTEXT, seq_tiles=TILES,
                                description=f"context_save with each layer's per-position parts in {TILES} sequence "
                                            f"tiles: a tile's intermediates at a time (128K on one H200)"),
        "context_offload_tiles": Recipe("context_offload_tiles", offload=CONTEXT, seq_tiles=TILES,
                                        description=f"context_offload in {TILES} sequence tiles"),
    }
    if grouped:
        out["long_context"] = Recipe("long_context", device=CONTEXT, offload=CARRY, seq_tiles=TILES, group=2,
                                     description=f"{kernel} output and statistics in HBM, the layer input of every "
                                                 f"second layer in pinned host memory, {TILES} sequence tiles: "
                                                 f"256K on one H200")
    if grouped and longest:
        out["longest_context"] = Recipe("longest_context", offload=CARRY, seq_tiles=TILES, group=4,
                                        group_keep=CONTEXT,
                                        description=f"the layer input of every fourth layer in pinned host memory, "
                                                    f"each group's layers keeping {kernel} output and statistics "
                                                    f"while the group's backward runs (two-level checkpoints), "
                                                    f"{TILES} sequence tiles: 512K on one H200")
        out["lead_context"] = Recipe("lead_context", offload=CARRY, seq_tiles=TILES, group=4, group_keep=CONTEXT,
                                     lead_device=CONTEXT,
                                     description=f"longest_context, the first layer of each group keeping {kernel} "
                                                 f"output and statistics in HBM between the passes too (one "
                                                 f"attention forward fewer per group): 512K on one H200 with "
                                                 f"--params stream")
    return out
