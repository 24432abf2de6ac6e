"""Attention over query tiles: a block's attention (its norm, q projection, attention and output projection) run one
tile of queries at a time, each tile against the keys up to it (`zoo.layers.prefix_attention`), each rematerialized
on its own. The keys and values of the whole sequence are made first (they are what every tile reads); a tile's
queries, attention output, statistics and output projection, and their gradients, exist one tile at a time. So a
layer's backward pass holds its input, keys, values and their gradients, not the whole sequence's queries and
outputs: what lets a layer's backward at a million positions fit beside the rest of a step.

The tags made inside a tile (`query_proj`, `attention_out`, `context`, `out_proj`) keep their whole shape for the
planner (`zoo.emitted` joins the tiles) and are recomputed tile by tile: a recipe may not keep or offload them.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from zoo.layers.tiles import check_tiles, rematerialized, tiled
from zoo.loop_guard import QUERY_TILE_SCOPE


def _keys_values(parts, x):
    norm, attn = parts
    return attn.project_kv(norm(x))


def _tile(parts, x, k, v, *, start: int, size: int):
    """One tile of `size` queries from `start`: the whole x, k and v come in (the same arrays for every tile, so the
    checkpoint saves no slice of them), the tile's slices are taken here."""
    norm, attn = parts
    here = slice(start, start + size)
    with jax.named_scope(QUERY_TILE_SCOPE):   # how the tag reader knows the tags made in a query tile
        q = attn.project_q(norm(x[:, here]))
        return attn.attend_tile(q, k[:, here], v[:, here], k[:, :start], v[:, :start])


def over_query_tiles(norm: Any, attn: Any, x: jax.Array, *, query_tiles: int, seq_tiles: int = 1) -> jax.Array:
    """`attn(norm(x))` (its output projection) computed over `query_tiles` tiles of queries.

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
    outs = [rematerialized(functools.partial(_tile, start=t * size, size=size), (norm, attn))(x, k, v)
            for t in range(query_tiles)]
    return jnp.concatenate(outs, axis=1)
