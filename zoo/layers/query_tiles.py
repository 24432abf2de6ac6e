"""Attention over query tiles: a block's attention (its norm, q projection, attention and output projection) run one
tile of queries at a time, in a loop, each tile against the keys up to it (`zoo.layers.tile_attention`), each
rematerialized on its own. The keys and values of the whole sequence are made first (they are what every tile
reads); a tile's queries, attention output, statistics and output projection, and their gradients, exist one tile at
a time. So a layer's backward pass holds its input, keys, values and their gradients, not the whole sequence's
queries and outputs. The price: attention's forward runs once more per layer (in each tile's own backward).

The tags made inside a tile (`query_proj`, `attention_out`, `context`, `out_proj`) keep their whole shape for the
planner (`zoo.emitted` reads this loop as it reads the sequence tiles') and are recomputed tile by tile: a recipe
may not keep or offload them.
"""
from __future__ import annotations

from typing import Any

import einops
import jax
import jax.numpy as jnp

from zoo.layers.tiles import check_tiles, rematerialized, tiled
from zoo.loop_guard import TILE_SCOPE


def _keys_values(parts, x):
    norm, attn = parts
    return attn.project_kv(norm(x))


def _tile(parts, x, k, v, start, k_all, v_all):
    norm, attn = parts
    return attn.attend_tile(attn.project_q(norm(x)), k, v, k_all, v_all, start)


def over_query_tiles(norm: Any, attn: Any, x: jax.Array, *, query_tiles: int, seq_tiles: int = 1) -> jax.Array:
    """`attn(norm(x))` (its output projection) computed over `query_tiles` tiles of queries, in a loop.

    Args:
        norm: the block's attention norm (an NNX module, [B, S, D] -> [B, S, D]).
        attn: the attention layer: `project_kv`, `named_kv`, `project_q` and `attend_tile` (`zoo.layers.Attention`).
        x: [B, S, D]; `query_tiles` divides S.
        query_tiles: the tiles of queries, run one after another.
        seq_tiles: sequence tiles of the keys' and values' projection (`zoo.layers.tiles`).

    Returns:
        [B, S, D]: what `attn(norm(x))` returns, up to rounding.
    """
    check_tiles(query_tiles, x.shape[1], what="attention_tiles")
    k, v = attn.named_kv(*tiled(_keys_values, (norm, attn), x, seq_tiles))
    n = query_tiles
    starts = jnp.arange(n, dtype=jnp.int32) * (x.shape[1] // n)
    xs = [einops.rearrange(a, "b (n t) ... -> n b t ...", n=n) for a in (x, k, v)] + [starts]
    body = rematerialized(_tile, (norm, attn), prevent_cse=False)
    with jax.named_scope(TILE_SCOPE):   # the loop of tiles, as the tag reader and the loop guard know it
        _, ys = jax.lax.scan(lambda carry, xs: (carry, body(*xs, k, v)), None, xs)
    return einops.rearrange(ys, "n b t ... -> b (n t) ...")
