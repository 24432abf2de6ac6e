"""The pre-norm residual decoder block every family of the zoo uses: x + attn(norm(x)), then x + ffn(norm(x)).

A family's decoder layer builds `attn_norm`, `attn`, `mlp_norm` and `mlp` (and sets `moe` when `mlp` returns
`(y, aux)`); the block applies them. `tiles` (a recipe's `seq_tiles`) runs the per-position parts over sequence
tiles (`zoo.layers.tiles`): the attention's norm with its q, k, v projections, and the dense FFN. An attention with
`query_tiles` above 1 runs over tiles of queries (`zoo.layers.query_tiles`).
"""
from __future__ import annotations

import jax

from zoo.layers.query_tiles import over_query_tiles
from zoo.layers.tagged import TaggedLayer
from zoo.layers.tiles import tiled


def _apply(module, x):
    return module(x)


def _ffn(parts, x):
    norm, mlp = parts
    return mlp(norm(x))


def _project(parts, x):
    norm, attn = parts
    return attn.project(norm(x))


class PreNormBlock(TaggedLayer):
    """The pre-norm residual block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)). A family's decoder layer
    subclasses it, building `attn_norm`, `attn`, `mlp_norm` and `mlp` in its `__init__` (and setting `moe = True`
    when `mlp` returns `(y, aux)`).

    Emits:
        the tags of its `attn` and `mlp` (e.g. `query_proj` ... `out_proj`, `mlpwi_0`, `mlpwi_1`, `mlpwo`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import MLP, RMSNorm
        >>> from zoo.layers.block import PreNormBlock
        >>> class Block(PreNormBlock):
        ...     def __init__(self, rngs):
        ...         self.dim, self.dtype = 8, jnp.float32
        ...         self.attn_norm, self.mlp_norm = RMSNorm(8), RMSNorm(8)
        ...         self.attn = MLP(dim=8, hidden=8, tag_prefix="shared_", rngs=rngs)  # any [B, S, D] layer
        ...         self.mlp = MLP(dim=8, hidden=16, rngs=rngs)
        >>> Block(nnx.Rngs(0))(jnp.ones((1, 4, 8)), tiles=2).shape
        (1, 4, 8)
    """
    moe: bool = False   # does `mlp` return (y, aux)?

    def __call__(self, x: jax.Array, *, tiles: int = 1):
        """Apply the block.

        Args:
            x: [B, S, D].
            tiles: run the per-position parts (the norms, the attention's projections, a dense MLP) over this many
                sequence tiles (`zoo.layers.tiles`; a recipe's `seq_tiles`).

        Returns:
            [B, S, D]; with `moe`, (that, the MLP's aux).
        """
        query_tiles = getattr(self.attn, "query_tiles", 1)
        if query_tiles > 1:
            x = x + over_query_tiles(self.attn_norm, self.attn, x, query_tiles=query_tiles, seq_tiles=tiles)
        elif hasattr(self.attn, "project"):
            x = x + self.attn.attend(*tiled(_project, (self.attn_norm, self.attn), x, tiles))
        else:
            x = x + self.attn(tiled(_apply, self.attn_norm, x, tiles))
        if not self.moe:
            return x + tiled(_ffn, (self.mlp_norm, self.mlp), x, tiles)
        y, aux = self.mlp(tiled(_apply, self.mlp_norm, x, tiles), tiles=tiles)
        return x + y, aux
