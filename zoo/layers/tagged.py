"""The one thing every offload-first layer can do besides computing: say which tags it emits.

`layer.tag_shapes(batch, seq)` traces the layer abstractly (no FLOPs, no memory) on a [batch, seq, dim] input
and returns {tag: shape and dtype} in the order the tags are made. For a config, build the layer with
`nnx.eval_shape` first: nothing is allocated either way.
"""
from __future__ import annotations

import jax
from flax import nnx

from zoo.emitted import emitted_by


class TaggedLayer(nnx.Module):
    """Base of layers over [B, S, dim] activations; subclasses set `self.dim` and `self.dtype`."""

    def tag_shapes(self, batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
        return emitted_by(self, jax.ShapeDtypeStruct((batch, seq, self.dim), self.dtype))
