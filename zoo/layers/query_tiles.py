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

import functools
from typing import Any

import jax

from zoo.layers.tiles import check_tiles, rematerialized, tile_loop, tiled


def _keys_values(parts, x):
    norm, attn = parts
    return attn.project_kv(norm(x))


def _tile(parts, x, k, v, start, *, size: int):
    """The tile of `size` queries from `start` (traced): its rows of x, k and v sliced here from the whole arrays,
    which are the same for every tile, so the loop keeps no per-tile copy of them."""
    norm, attn = parts
    rows = [jax.lax.dynamic_slice_in_dim(a, start, size, axis=1) for a in (x, k, v)]
    return attn.attend_tile(attn.project_q(norm(rows[0])), rows[1], rows[2], k, v, start)


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
    size = x.shape[1] // query_tiles
    body = rematerialized(functools.partial(_tile, size=size), (norm, attn), prevent_cse=False)
    return tile_loop(lambda start: body(x, k, v, start), x.shape[1], query_tiles)
