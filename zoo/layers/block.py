"""The pre-norm residual decoder block every family of the zoo uses: x + attn(norm(x)), then x + ffn(norm(x)).

A family's decoder layer builds `attn_norm`, `attn`, `mlp_norm` and `mlp`, and sets `moe` when `mlp` is a mixture
of experts (which returns `(y, aux)`: the block then returns `(x, aux)` too); the block applies them.
"""
from __future__ import annotations

import jax

from zoo.layers.tagged import TaggedLayer


class PreNormBlock(TaggedLayer):
    moe: bool = False   # does `mlp` return (y, aux)?

    def __call__(self, x: jax.Array):
        x = x + self.attn(self.attn_norm(x))
        if not self.moe:
            return x + self.mlp(self.mlp_norm(x))
        y, aux = self.mlp(self.mlp_norm(x))
        return x + y, aux
