"""The pre-norm residual decoder block every family of the zoo uses: x + attn(norm(x)), then x + ffn(norm(x)).

A family's decoder layer builds `attn_norm`, `attn`, `mlp_norm` and `mlp` (and sets `moe` when `mlp` returns
`(y, aux)`); the block applies them. `tiles` (a recipe's `seq_tiles`) runs the per-position parts over sequence
tiles (`zoo.layers.tiles`): the attention's norm with its q, k, v projections, and the dense FFN.
"""
from __future__ import annotations

import jax

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
    moe: bool = False   # does `mlp` return (y, aux)?

    def __call__(self, x: jax.Array, *, tiles: int = 1):
        if hasattr(self.attn, "project"):
            x = x + self.attn.attend(*tiled(_project, (self.attn_norm, self.attn), x, tiles))
        else:
            x = x + self.attn(tiled(_apply, self.attn_norm, x, tiles))
        if not self.moe:
            return x + tiled(_ffn, (self.mlp_norm, self.mlp), x, tiles)
        y, aux = self.mlp(tiled(_apply, self.mlp_norm, x, tiles), tiles=tiles)
        return x + y, aux
